"""GPU check for a lent machine: Unsloth's FastVisionModel LoRA on the tiny Qwen2-VL, from prepared rows; peak VRAM.

  python tests/bench/gpu_vision_check.py [--steps N] [--n N] [--json OUT]

Builds the tiny Qwen2-VL (`fixtures.tiny_vision_model`, its own processor), draws N conversations with images,
prepares them (`vision.prepare_vision`: image references + grids) and runs `vision.train_vision`, which takes
`FastVisionModel` when CUDA is available. Reports the backend, the losses, peak VRAM allocated
(`torch.cuda.max_memory_allocated`) and the weights' own size for scale. Exit 1 if the run did not go through
Unsloth, a loss is not finite, or no step ran. Without a GPU it says so and exits 0 (nothing to check).
"""
import argparse, json, math, sys, tempfile
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import unsloth  # noqa: F401  (before transformers, as Unsloth asks)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU path is tests/test_vision.py)")
        return 0
    from unsloth_prep.fixtures import tiny_vision_model, write_vision_records
    from unsloth_prep.vision import prepare_vision, train_vision
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model = tiny_vision_model(d / "tiny-vl")
        data = write_vision_records(d / "data", a.n, size=(224, 168), multi_rate=0.25)
        prep = prepare_vision(data["path"], model, d / "vision.parquet")
        torch.cuda.reset_peak_memory_stats()
        r = train_vision(d / "vision.parquet", model, d / "run", max_steps=a.steps, batch_size=4)
        weights_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    res = {"gpu": torch.cuda.get_device_name(0), "backend": r["backend"], "steps": r["steps"], "losses": r["losses"],
           "cuda_peak_mb": round(r["cuda_peak_mb"] or 0, 1), "weights_mb": round(weights_mb, 2),
           "rows": prep["rows"], "image_tokens": prep["image_tokens"], "seconds": r["seconds"]}
    print(json.dumps(res))
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1))
    ok = r["backend"] == "unsloth.FastVisionModel" and r["steps"] == a.steps and all(map(math.isfinite, r["losses"]))
    print("FastVisionModel LoRA on the tiny Qwen2-VL:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
