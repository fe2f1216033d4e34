"""Peak RSS of `merge_adapter` (the `export` merge) in fresh processes, for random Llama models of growing size and two
export dtypes, next to `export.merge_peak_mb`'s estimate and the imports alone.

    python tests/bench/bench_export.py [--small]
"""
import argparse, json, sys, tempfile
from pathlib import Path

SIZES = [(512, 8), (1024, 8), (1024, 16)]     # (hidden, layers)


def random_run(tmp: Path, hidden: int, layers: int):
    "A base model of the given size and a random nonzero LoRA adapter on it, saved like a `train` run."
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from unsloth_prep.fixtures import tiny_model
    spec = dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128)
    base = tiny_model(tmp / f"base_{hidden}_{layers}", spec)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = tmp / f"run_{hidden}_{layers}" / "adapter"
    get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=targets, init_lora_weights=False)
                   ).save_pretrained(str(adapter))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(adapter))
    return adapter.parent, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="only the smallest model")
    args = ap.parse_args()
    from unsloth_prep.oom import merge_peak_mb
    from unsloth_prep.memory import run_code
    tmp = Path(tempfile.mkdtemp())
    rows = []
    imports = run_code("import torch, transformers, peft, safetensors\nresult = None", label="imports").peak_mb
    for hidden, layers in SIZES[:1] if args.small else SIZES:
        run_dir, n = random_run(tmp, hidden, layers)
        for dtype in ("float32", "bfloat16"):
            out = run_dir / f"merged_{dtype}"
            code = (f"from unsloth_prep.export import merge_adapter\n"
                    f"result = merge_adapter({str(run_dir)!r}, {str(out)!r}, {dtype!r}, 'peft', True)")
            r = run_code(code, label=f"merge {dtype}")
            est = merge_peak_mb(n, dtype, source_dtype="float32")     # the random bases are stored in float32
            rows.append({"params_m": round(n / 1e6, 1), "dtype": dtype, "peak_mb": round(r.peak_mb),
                         "imports_mb": round(imports), "estimate_mb": round(est),
                         "written_mb": r.value["size_mb"], "seconds": round(r.seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
