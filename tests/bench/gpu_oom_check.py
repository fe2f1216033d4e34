#!/usr/bin/env python
"""GPU check of `unsloth_prep.oom.estimate` against `torch.cuda.max_memory_allocated` for one real training step.

    python tests/bench/gpu_oom_check.py            # on a machine with a CUDA GPU; < 3 minutes; prints ONE JSON line

A Llama-3.2-1B-shaped model is built from its config numbers (random weights, nothing downloaded), saved to a temp
folder and loaded back through Unsloth's `FastLanguageModel` (4-bit NF4 and 16-bit), LoRA r=16 on all linears, one
forward + backward + AdamW-8bit step on random tokens. Each run resets the CUDA peak first. The estimate is compared
without its CUDA-context share (0.5 GiB, which `max_memory_allocated` does not see). Without Unsloth it falls back to
transformers + PEFT (backend "peft", full logits, torch checkpointing). Without CUDA it prints {"skipped": ...}.
"""
import json, shutil, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the working tree's unsloth_prep, installed or not
T0 = time.time()
BUDGET_S = 150
RUNS = [  # (load, checkpointing, batch, seq_len)
    ("4bit", "unsloth", 2, 1024),
    ("16bit", "unsloth", 2, 1024),
    ("16bit", False, 1, 1024),
    ("4bit", "unsloth", 4, 2048),
]


def build_model(folder, arch_name="llama-3.2-1b"):
    """Random-init model of a known architecture saved (bf16) with the fixture tokenizer into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, AutoTokenizer
    from unsloth_prep.oom import KNOWN_CONFIGS
    from unsloth_prep.fixtures import tiny_model
    cfg = {k: v for k, v in KNOWN_CONFIGS[arch_name].items() if k != "model_type"}
    conf = LlamaConfig(**cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_model())).save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def one_step(folder, load, ckpt, batch, seq, backend):
    """Load, attach LoRA, run one optimizer step; return CUDA peak allocated bytes and seconds."""
    import gc, torch
    gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if backend == "unsloth":
        from unsloth import FastLanguageModel
        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=seq, load_in_4bit=load == "4bit",
                                                     dtype=torch.bfloat16)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, target_modules=targets,
                                                 use_gradient_checkpointing=ckpt, random_state=0)
    else:
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16) if load == "4bit" else None
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=q, device_map={"": 0})
        if load == "4bit": model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(ckpt))
        elif ckpt: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}); model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0, target_modules=targets, task_type="CAUSAL_LM"))
    model.train()
    import bitsandbytes as bnb
    opt = bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(8, model.config.vocab_size, (batch, seq), device="cuda")
    t = time.time()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    secs = time.time() - t
    peak = torch.cuda.max_memory_allocated()
    del model, opt, out, ids
    return peak, secs


def main():
    try:
        import torch
    except ImportError:
        print(json.dumps({"skipped": "torch not installed"})); return
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"})); return
    backend = "unsloth"
    try:
        import unsloth  # noqa: F401  (first, before transformers)
    except Exception as e:
        backend = "peft"; why = f"{type(e).__name__}: {e}"[:200]
    from unsloth_prep.oom import estimate, load_arch, KNOWN_CONFIGS
    folder = tempfile.mkdtemp(prefix="gpu_oom_")
    res = {"gpu": torch.cuda.get_device_name(0), "backend": backend, "torch": torch.__version__, "runs": []}
    if backend == "peft": res["unsloth_error"] = why
    try:
        build_model(folder)
        arch = load_arch(KNOWN_CONFIGS["llama-3.2-1b"])
        for load, ckpt, batch, seq in RUNS:
            if time.time() - T0 > BUDGET_S: res["runs"].append({"load": load, "skipped": "time budget"}); continue
            est = estimate(arch, load=load, checkpointing=ckpt if backend == "unsloth" else bool(ckpt), batch_size=batch, seq_len=seq,
                           lora_rank=16, optimizer="adamw_8bit", dtype="bf16", device="cuda", fused_loss=backend == "unsloth")
            predicted = est.total_bytes - 0.5 * 2**30  # the CUDA context is outside max_memory_allocated
            row = {"load": load, "checkpointing": ckpt, "batch": batch, "seq_len": seq,
                   "predicted_gb": round(predicted / 2**30, 3), "items_gb": est.as_dict()["items_gb"]}
            try:
                peak, secs = one_step(folder, load, ckpt, batch, seq, backend)
                row.update(measured_gb=round(peak / 2**30, 3), error=round(predicted / peak - 1, 3), step_s=round(secs, 2))
            except Exception as e:
                row["error_msg"] = f"{type(e).__name__}: {e}"[:300]
            res["runs"].append(row)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    errs = [abs(r["error"]) for r in res["runs"] if "error" in r]
    res["max_abs_error"] = max(errs) if errs else None
    res["seconds"] = round(time.time() - T0, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
