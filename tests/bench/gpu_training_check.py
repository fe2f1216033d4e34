"""GPU check (run only on a lent GPU; nothing in CI depends on it): packed vs padded training on a small real-size model.

    PYTHONPATH=. python tests/bench/gpu_training_check.py            # needs CUDA, < 3 minutes
    PYTHONPATH=. python tests/bench/gpu_training_check.py --cpu-smoke # scaled-down dry run of the script on CPU

Builds a Llama-architecture model from a config (about 0.2B parameters, random weights, the project's local BPE
tokenizer: no download), prepares generated conversations with `unsloth_prep.tokenization.prepare`, then trains it with
`unsloth_prep.training.train` (Unsloth + LoRA + SFTTrainer) twice on the same rows: padded and packed. Reports real
tokens/s, `torch.cuda.max_memory_allocated` per run, the loss, and whether an example inside a packed row gets the same
logits as alone on the GPU attention path. Prints one JSON line, last.
"""
import argparse, gc, json, sys, tempfile, time
from pathlib import Path

import unsloth  # noqa: F401  (before transformers / trl)


def build_model(path: Path, small: bool) -> Path:
    "A randomly initialised Llama from a config (no download), saved with the tiny fixture tokenizer."
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from unsloth_prep.fixtures import tiny_model
    tok = AutoTokenizer.from_pretrained(str(tiny_model()))
    dims = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2) if small \
        else dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **dims)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    model.save_pretrained(path); tok.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def cross_talk(model_path, rows, max_seq_length) -> dict:
    "Max |logit diff| of an example inside a packed row (position_ids only) vs alone, on the LoRA model in train mode."
    import torch
    from unsloth import FastLanguageModel
    m, _ = FastLanguageModel.from_pretrained(model_path, max_seq_length=max_seq_length, load_in_4bit=False, dtype=None)
    m = FastLanguageModel.get_peft_model(m, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], random_state=0)
    m.train()
    a, b = rows[0]["input_ids"][:64], rows[1]["input_ids"][:64]
    dev = next(m.parameters()).device
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))], device=dev)
    with torch.no_grad():
        alone = m(input_ids=torch.tensor([b], device=dev)).logits[0].float()
        packed = m(input_ids=torch.tensor([a + b], device=dev), position_ids=pos).logits[0, len(a):].float()
    out = {"packed_vs_alone_max_abs": round((packed - alone).abs().max().item(), 5),
           "alone_max_abs": round(alone.abs().max().item(), 3)}
    del m; gc.collect(); torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, runs on CPU: checks the script, not the GPU")
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available() and not a.cpu_smoke:
        sys.exit("no CUDA device: run on a GPU, or pass --cpu-smoke for a scaled-down dry run")
    from datasets import Dataset
    from unsloth_prep.fixtures import iter_records
    from unsloth_prep.tokenizer import load_tokenizer
    from unsloth_prep.tokenization import prepare
    from unsloth_prep.training import train
    t0 = time.perf_counter()
    small = a.cpu_smoke
    seq, n, steps, bs = (256, 120, a.steps or 4, 2) if small else (1024, 3000, a.steps or 30, 8)
    work = Path(tempfile.mkdtemp(prefix="gpu_training_check_"))
    model_path, n_params = build_model(work / "model", small)
    prep = prepare(iter_records(n, "openai", seed=0), load_tokenizer(str(model_path)), work / "prepared.parquet", max_seq_length=seq)
    rows = Dataset.from_parquet(prep["out"]).select(range(2)).to_list()
    runs = {}
    for packed in (False, True):
        cfg = {"data": {"path": prep["out"]}, "model": {"name": str(model_path), "load_in_4bit": False},
               "max_seq_length": seq, "packing": packed, "generate": None,
               "lora": {"r": 16, "alpha": 16},
               "trainer": {"max_steps": steps, "learning_rate": 1e-3, "per_device_train_batch_size": bs,
                           "gradient_accumulation_steps": 1, "warmup_steps": 2, "logging_steps": 1},
               "output_dir": str(work / ("packed" if packed else "padded"))}
        s = train(cfg)
        runs["packed" if packed else "padded"] = {k: s[k] for k in ("steps", "tokens", "train_seconds", "tokens_per_s",
                                                                    "first_loss", "final_loss", "cuda_peak_mb", "peak_rss_mb", "dtype")}
        gc.collect(); torch.cuda.empty_cache() if torch.cuda.is_available() else None
    iso = cross_talk(str(model_path), rows, seq)
    out = {"check": "gpu_training", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke)",
           "params_m": round(n_params / 1e6, 1), "max_seq_length": seq, "batch_size": bs, "steps": steps,
           "prepared_rows": prep["rows"], "runs": runs,
           "packed_over_padded_tokens_per_s": round(runs["packed"]["tokens_per_s"] / runs["padded"]["tokens_per_s"], 2),
           "cuda_max_allocated_mb": {k: (v["cuda_peak_mb"] or {}).get("allocated") for k, v in runs.items()},
           "packed_isolation": iso, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
