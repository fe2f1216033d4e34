"""Packed vs padded training throughput on the CPU tiny model (Unsloth + LoRA + SFTTrainer), each run in a fresh process.

    flock /tmp/heavy.lock python tests/bench/bench_training.py [--small] [--threads N]

Same prepared rows, same steps and batch size; tokens/s counts real (non-pad) tokens the model's forward received.
Prints a table and one JSON line.
"""
import argparse, json, sys, tempfile
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="fewer records and steps, one repeat")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadier on a shared machine)")
    ap.add_argument("--max-seq-length", type=int, default=256)
    a = ap.parse_args(argv)
    from unsloth_prep.fixtures import iter_records, tiny_model
    from unsloth_prep.memory import isolated
    from unsloth_prep.tokenizer import load_tokenizer
    from unsloth_prep.tokenization import prepare
    from unsloth_prep.training import train
    n, steps, repeats = (200, 12, 1) if a.small else (600, 30, 2)
    work = Path(tempfile.mkdtemp(prefix="bench_training_"))
    model = str(tiny_model())
    prep = prepare(iter_records(n, "openai", seed=0), load_tokenizer(model), work / "prepared.parquet", max_seq_length=a.max_seq_length)
    rows = []
    for rep in range(repeats):
        for packed in (False, True):
            cfg = {"data": {"path": prep["out"]}, "model": {"name": model, "cpu_threads": a.threads},
                   "max_seq_length": a.max_seq_length, "packing": packed, "generate": None,
                   "lora": {"r": 16, "alpha": 16, "modules_to_save": ["lm_head"]},
                   "trainer": {"max_steps": steps, "learning_rate": 5e-3, "per_device_train_batch_size": 4, "warmup_steps": 2},
                   "output_dir": str(work / f"run_{rep}_{packed}")}
            r = isolated(train, cfg, label=f"{'packed' if packed else 'padded'}#{rep}", keep_result=True)
            s = r.value
            rows.append({"mode": "packed" if packed else "padded", "repeat": rep, "steps": s["steps"], "tokens": s["tokens"],
                         "train_s": s["train_seconds"], "tokens_per_s": s["tokens_per_s"],
                         "steps_per_s": round(s["steps"] / s["train_seconds"], 2), "first_loss": round(s["first_loss"], 3),
                         "final_loss": round(s["final_loss"], 3), "peak_rss_mb": round(r.peak_mb, 1)})
    print(f"\n{'mode':8}{'rep':>4}{'steps':>6}{'tokens':>8}{'train s':>9}{'tok/s':>9}{'steps/s':>9}{'loss first->final':>20}{'peak MB':>9}")
    for x in rows:
        print(f"{x['mode']:8}{x['repeat']:>4}{x['steps']:>6}{x['tokens']:>8}{x['train_s']:>9.2f}{x['tokens_per_s']:>9.0f}"
              f"{x['steps_per_s']:>9.2f}{x['first_loss']:>10.3f} ->{x['final_loss']:>7.3f}{x['peak_rss_mb']:>9.0f}")
    best = {m: max(x["tokens_per_s"] for x in rows if x["mode"] == m) for m in ("padded", "packed")}
    out = {"bench": "training", "small": a.small, "threads": a.threads, "max_seq_length": a.max_seq_length,
           "records": n, "prepared_rows": prep["rows"], "steps": steps, "batch_size": 4, "best_tokens_per_s": best,
           "packed_over_padded": round(best["packed"] / best["padded"], 2), "runs": rows}
    print(f"packed / padded tokens/s (best of {repeats}): {out['packed_over_padded']}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
