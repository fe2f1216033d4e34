#!/usr/bin/env python
"""Benchmark: Parquet writer settings for token columns, on the tables `prepare` writes.

    python tests/bench/bench_token_parquet.py            # 100 MB inputs: chat SFT, DPO pairs, pretraining blocks
    python tests/bench/bench_token_parquet.py --mb 20    # smaller, a minute

Each task's output is prepared once (Llama-3.2's tokenizer, as `bench_floor.py` makes the files), then rewritten with
each setting in tables of the size `prepare` writes them (256 rows of chat or pairs, 2^18 tokens of blocks). Each
(task, setting) runs in a fresh process: CPU seconds of the writer (best of --repeat) and the file's size. The first
row is what `unsloth_prep.base.ParquetSink` writes with `TOKEN_PARQUET` today (a dictionary for every column but
`PLAIN_COLUMNS`); the rows after it give every column one, or none.
"""
import argparse, json, subprocess, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_floor as B
from unsloth_prep.base import TOKEN_PARQUET

SETTINGS = {
    "TOKEN_PARQUET (today)": {**TOKEN_PARQUET, "sink": True},
    "zstd 1 + dictionary, statistics": dict(compression="zstd", compression_level=1, use_dictionary=True),
    "zstd 1 + dictionary, no statistics": dict(compression="zstd", compression_level=1, use_dictionary=True,
                                               write_statistics=False),
    "lz4 + dictionary, no statistics": dict(compression="lz4", use_dictionary=True, write_statistics=False),
    "zstd 1, no dictionary, no statistics": dict(compression="zstd", compression_level=1, use_dictionary=False,
                                                 write_statistics=False),
}

WRITE = """import json, os, sys, time, pyarrow.parquet as pq
src, dst, rows, kw, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
t = pq.read_table(src).replace_schema_metadata(None)
if kw.pop("sink", False):                               # what ParquetSink makes of these settings
    from unsloth_prep.base import sink_options
    kw = sink_options(t.schema, kw)
batches = t.to_batches(max_chunksize=rows)
best = None
for _ in range(repeat):
    c0 = time.process_time()
    w = pq.ParquetWriter(dst, t.schema, **kw)
    for b in batches: w.write_batch(b)
    w.close()
    best = min(best or 1e9, time.process_time() - c0)
print(json.dumps({"cpu_s": round(best, 3), "mb": round(os.path.getsize(dst) / 1e6, 1), "rows": t.num_rows}))
"""


def outputs(mb: float, work: Path) -> dict:
    "The prepared file of each task (made once, cached by name): (path, rows per written table)."
    tok, out, B.REPEAT = B.llama_folder(), {}, 1
    for task, extra, rows in (("sft", (), 256), ("dpo", (), 256), ("pretrain", ("--block-size", "2048"), 128)):
        src = work / (f"alpaca-fixture-{mb:g}mb.jsonl" if task == "sft" else f"{task}-{mb:g}mb.jsonl")
        if task == "sft": B.make_data(src, mb, "fixture")
        else: B.make_task_data(src, mb, task)
        dst = work / f"tokparquet-{task}-{mb:g}"
        if not (dst / "_manifest.json").exists():
            B.prepare(str(src), tok, str(dst), None, task=task, extra=extra)
        out[task] = (next(dst.glob("train-*.parquet")), rows)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100, help="MB of each task's input (default 100)")
    ap.add_argument("--repeat", type=int, default=3, help="writes per process, best kept (default 3)")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "bench_floor"))
    a = ap.parse_args()
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    files, res = outputs(a.mb, work), {}
    print(f"load before: {B.uptime()}")
    print("| setting | " + " | ".join(f"{t} CPU s | {t} MB" for t in files) + " |")
    print("|---|" + "---:|---:|" * len(files))
    for name, kw in SETTINGS.items():
        cells = []
        for task, (src, rows) in files.items():
            argv = [sys.executable, "-c", WRITE, str(src), str(work / "tokparquet.parquet"), str(rows),
                    json.dumps(kw), str(a.repeat)]
            r = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            res.setdefault(name, {})[task] = r
            cells += [f"{r['cpu_s']:.2f}", f"{r['mb']:.1f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"load after: {B.uptime()}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
