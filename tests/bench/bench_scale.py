#!/usr/bin/env python
"""Benchmark of unsloth_prep.parallel and the bounded pack, each run in a fresh process.

  python tests/bench/bench_scale.py [--small] [--part pack|prepare|all]

1. pack: peak RSS of `pack_parquet` (bounded: lengths first, external sort into per-row-group runs) on tokenized
   Parquet files of about 30M, 100M and 300M tokens (--small: 30M and 90M), beside packing the whole table in memory
   with `pack_table` on the smallest. Targets: peak <= 400 MB at ~32.8M tokens, flat (+-25%) across sizes.
2. prepare: the same generated JSONL through (a) one process pinned to one core (tokenizer on one thread; the same
   process unpinned, which overlaps rendering and encoding on two cores, is shown beside it); (b) `--workers 2`
   (pipeline.run_prepare, each worker one thread); (c) the Ray Data engine with 2 actors on a local cluster (the
   cluster's start and Ray Data's first job, which starts its helper actors, timed apart). Targets: (b) >= 1.6x (a) in records/s; per-worker peak <= 350 MB; (c) >= 0.7x (b), per-actor
   peak <= 450 MB. Per-worker peaks come from the manifest (each worker's own ru_maxrss).
3. convert: MB/s of one process, `--workers 2` and Ray (2 actors) on the same JSONL; the shard tables must equal the
   one-process table.
Prints a table per part, then one JSON line. Figures from a shared machine are indicative.
"""
import argparse, json, os, shutil, sys, tempfile, textwrap, time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from unsloth_prep.memory import run_code


def tokenized_parquet(path, tokens, mean_len=1190, vocab=128_000, seed=0, rows_per_group=1000):
    """A tokenized Parquet file (input_ids, attention_mask, labels as list<int32>) of about `tokens` tokens, written
    in row groups of `rows_per_group` rows as `prepare` writes them; log-normal lengths around `mean_len`."""
    rng = np.random.default_rng(seed)
    writer, done = None, 0
    while done < tokens:
        lens = np.clip(rng.lognormal(np.log(mean_len) - 0.32, 0.8, rows_per_group).astype(np.int64), 8, 16_000)
        off = np.r_[0, np.cumsum(lens)].astype(np.int32)
        ids = rng.integers(0, vocab, int(off[-1]), dtype=np.int32)
        labels = ids.copy()
        labels[rng.random(len(ids)) < 0.3] = -100
        t = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(off), pa.array(ids)),
                      "attention_mask": pa.ListArray.from_arrays(pa.array(off), pa.array(np.ones(len(ids), np.int32))),
                      "labels": pa.ListArray.from_arrays(pa.array(off), pa.array(labels))})
        writer = writer or pq.ParquetWriter(path, t.schema)
        writer.write_table(t)
        done += int(off[-1])
    writer.close()
    return done


def bench_pack(work, sizes, L=2048):
    """Peak RSS and seconds of the bounded pack per size, and of the in-memory pack_table on the first size."""
    out = []
    for i, n in enumerate(sizes):
        src = work / f"tok_{n}.parquet"
        tokens = tokenized_parquet(src, n)
        code = (f"from unsloth_prep.collators import pack_parquet\n"
                f"result = pack_parquet({str(src)!r}, {str(work / 'packed.parquet')!r}, {L}, progress=False)")
        r = run_code(code, label=f"bounded {tokens / 1e6:.0f}M")
        row = {"tokens": tokens, "mb_file": src.stat().st_size / 2**20, "peak_mb": r.peak_mb, "seconds": r.seconds,
               "rows": r.value["rows"], "efficiency": r.value["efficiency"]}
        if i == 0:
            mem = run_code(f"import pyarrow.parquet as pq\nfrom unsloth_prep.collators import pack_table\n"
                           f"t = pq.read_table({str(src)!r}, columns=['input_ids', 'labels'])\n"
                           f"p, st = pack_table(t, {L})\npq.write_table(p, {str(work / 'mem.parquet')!r})\n"
                           f"result = st['rows']", label="in memory")
            row.update(memory_peak_mb=mem.peak_mb, memory_seconds=mem.seconds, memory_rows=mem.value)
        out.append(row)
        src.unlink()
    peaks = [r["peak_mb"] for r in out]
    targets = {"pack_peak_le_400_at_smallest": peaks[0] <= 400,
               "pack_flat_25pct": max(peaks) <= 1.25 * min(peaks),
               "same_rows_as_memory": out[0]["rows"] == out[0]["memory_rows"]}
    print(f"\n{'tokens':>12s} {'file MB':>8s} {'peak MB':>8s} {'s':>7s} {'rows':>8s} {'eff':>7s}")
    for r in out:
        print(f"{r['tokens']:12,d} {r['mb_file']:8.0f} {r['peak_mb']:8.0f} {r['seconds']:7.1f} {r['rows']:8,d} "
              f"{100 * r['efficiency']:6.2f}%")
    print(f"in memory (pack_table) on the first: peak {out[0]['memory_peak_mb']:.0f} MB, {out[0]['memory_seconds']:.1f} s")
    print("pack targets:", targets)
    return {"rows": out, "targets": targets}


PREPARE_SINGLE = """
import os
os.environ["RAYON_NUM_THREADS"] = "1"
if {pin}: os.sched_setaffinity(0, {{0}})   # one core: rendering and the encoding thread take turns
import time
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep.tokenization import prepare
t0 = time.perf_counter()
s = prepare({data!r}, load_tokenizer({tok!r}), {out!r}, on_error="skip", max_seq_length=4096)
result = {{"records": s["records"], "rows": s["rows"], "seconds": time.perf_counter() - t0}}
"""

RAY_START = """t_start = 0.0
if {engine!r} == "ray":   # the cluster and Ray Data's own helper actors start once per cluster: timed apart
    from unsloth_prep.parallel import _ray_init
    t = time.perf_counter()
    _ray_init(2).data.range(2).map_batches(lambda b: b).take_all()
    t_start = time.perf_counter() - t
"""

PREPARE_SHARDED = """
import os
os.environ["RAYON_NUM_THREADS"] = "1"
import time
from unsloth_prep.outputs import read_manifest
from unsloth_prep.pipeline import parse_request, run_prepare
{ray_start}t0 = time.perf_counter()
m = run_prepare(*parse_request({{"data": {data!r}, "tokenizer": {tok!r}, "out": {out!r}, "workers": 2, "on_error": "skip",
                                "max_seq_length": 4096, "engine": {engine!r}, "progress": False}}, "python"))
shards = read_manifest({out!r})["shards"]
result = {{"records": m["records"], "rows": m["rows"], "seconds": time.perf_counter() - t0, "start_s": t_start,
          "worker_peaks": [s["worker"]["peak_rss_mb"] for s in shards],
          "torch_in_workers": [s["worker"]["torch_imported"] for s in shards]}}
"""


def bench_prepare(work, size_mb):
    """Records/s of one single-threaded process, two workers, and Ray with two actors, on the same JSONL."""
    from unsloth_prep.fixtures import tiny_model, write_records
    from unsloth_prep.parallel import rows_digest
    from unsloth_prep.outputs import data_files
    data, tok = work / "chat.jsonl", str(tiny_model())
    info = write_records(data, size_mb=size_mb, fmt="openai", seed=5)
    runs = {"one process, 1 core": PREPARE_SINGLE.format(data=str(data), tok=tok, out=str(work / "single.parquet"),
                                                         pin=True),
            "one process, 2 cores": PREPARE_SINGLE.format(data=str(data), tok=tok, out=str(work / "single2.parquet"),
                                                          pin=False),
            **{k: PREPARE_SHARDED.format(data=str(data), tok=tok, out=str(work / o), engine=e,
                                         ray_start=RAY_START.format(engine=e))
               for k, o, e in (("--workers 2", "w2", "local"), ("ray, 2 actors", "ray", "ray"))}}
    # the memory sampler polls every 0.1 s, not 5 ms: with three processes to read it would take CPU from the work
    res = {k: run_code(textwrap.dedent(c), label=k, interval=0.1) for k, c in runs.items()}
    same = {k: rows_digest(data_files(work / d)) == rows_digest(work / "single.parquet") for k, d in (("w2", "w2"), ("ray", "ray"))}
    out = {}
    for k, r in res.items():
        v = r.value
        out[k] = {"records_per_s": v["records"] / v["seconds"], "seconds": v["seconds"], "peak_mb": r.peak_mb,
                  "worker_peaks_mb": v.get("worker_peaks"), "start_s": v.get("start_s"),
                  "torch_in_workers": v.get("torch_in_workers")}
    one, one2, w2, ray = (out[k]["records_per_s"] for k in runs)
    targets = {"workers2_ge_1.6x": w2 >= 1.6 * one, "worker_peak_le_350": max(out["--workers 2"]["worker_peaks_mb"]) <= 350,
               "ray_ge_0.7x_workers2": ray >= 0.7 * w2, "actor_peak_le_450": max(out["ray, 2 actors"]["worker_peaks_mb"]) <= 450,
               "identical_rows": all(same.values())}
    print(f"\n{info['records']:,} records, {info['bytes'] / 2**20:.1f} MB JSONL")
    print(f"{'engine':24s} {'rec/s':>8s} {'s':>7s} {'peak MB (all)':>14s} {'per-worker peak MB':>20s}")
    for k, o in out.items():
        peaks = "" if not o["worker_peaks_mb"] else "/".join(f"{p:.0f}" for p in o["worker_peaks_mb"])
        print(f"{k:24s} {o['records_per_s']:8.1f} {o['seconds']:7.1f} {o['peak_mb']:14.0f} {peaks:>20s}")
    print(f"ratios: workers2/one core {w2 / one:.2f}x (workers2/one unpinned process {w2 / one2:.2f}x), "
          f"ray/workers2 {ray / w2:.2f}x; Ray cluster start "
          f"{out['ray, 2 actors']['start_s']:.1f} s (not counted); torch imported in workers: "
          f"{out['--workers 2']['torch_in_workers']}")
    print("prepare targets:", targets)
    return {"records": info["records"], "mb": info["bytes"] / 2**20, "engines": out, "targets": targets}


CONVERT = """
import time
from unsloth_prep.convert import convert
import argparse, contextlib, io
from unsloth_prep.pipeline import convert_args, convert_main
{ray_start}t0 = time.perf_counter()
if {workers} == 1: s = convert({src!r}, {out!r}, progress=False)
else:
    p = argparse.ArgumentParser()
    convert_args(p)
    args = p.parse_args([{src!r}, "--out", {out!r}, "--workers", "{workers}", "--engine", {engine!r}, "--no-progress"])
    with contextlib.redirect_stdout(io.StringIO()): s = convert_main(args)
result = {{"rows": s["rows"], "seconds": time.perf_counter() - t0, "start_s": t_start,
          "worker_peak": s.get("worker_peak_rss_mb")}}
"""


def bench_convert(work, size_mb):
    """MB/s of `convert` in one process, with `--workers 2`, and with Ray (2 actors) on the same JSONL."""
    from unsloth_prep.fixtures import write_records
    from unsloth_prep.outputs import data_files
    src = work / "conv.jsonl"
    info = write_records(src, size_mb=size_mb, fmt="alpaca", malformed_rate=0.0005, seed=7)
    runs = {"one process": (1, "local", "one.parquet"), "--workers 2": (2, "local", "w2"),
            "ray, 2 actors": (2, "ray", "ray")}
    out = {}
    for k, (w, engine, o) in runs.items():
        code = CONVERT.format(engine=engine, workers=w, src=str(src), out=str(work / o),
                              ray_start=RAY_START.format(engine=engine))
        r = run_code(textwrap.dedent(code),
                     label=k, interval=0.1)
        out[k] = {"mb_per_s": info["bytes"] / 2**20 / r.value["seconds"], "seconds": r.value["seconds"],
                  "peak_mb": r.peak_mb, "worker_peak_mb": r.value["worker_peak"], "start_s": r.value["start_s"]}
    one = pq.read_table(work / "one.parquet")
    same = {k: pq.read_table(data_files(work / o)).equals(one) for k, (w, e, o) in runs.items() if w > 1}
    print(f"\nconvert: {info['records']:,} records, {info['bytes'] / 2**20:.0f} MB JSONL")
    print(f"{'engine':16s} {'MB/s':>7s} {'s':>7s} {'peak MB (driver)':>17s} {'per-worker peak MB':>19s}")
    for k, o in out.items():
        print(f"{k:16s} {o['mb_per_s']:7.1f} {o['seconds']:7.1f} {o['peak_mb']:17.0f} {o['worker_peak_mb'] or '':>19}")
    print(f"workers2/one {out['--workers 2']['mb_per_s'] / out['one process']['mb_per_s']:.2f}x, ray/workers2 "
          f"{out['ray, 2 actors']['mb_per_s'] / out['--workers 2']['mb_per_s']:.2f}x; same table: {same}")
    return {"mb": info["bytes"] / 2**20, "engines": out, "same_table": same}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="30M and 90M tokens for pack, 4 MB of JSONL for prepare")
    p.add_argument("--part", default="all", choices=("pack", "prepare", "convert", "all"))
    p.add_argument("--prepare-mb", type=float, default=None, help="MB of JSONL for prepare (default 20; 4 with --small)")
    p.add_argument("--convert-mb", type=float, default=None, help="MB of JSONL for convert (default 400; 40 with --small)")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    res = {"small": a.small}
    try:
        if a.part in ("pack", "all"):
            sizes = (32_800_000, 90_000_000) if a.small else (32_800_000, 100_000_000, 300_000_000)
            res["pack"] = bench_pack(work, sizes)
        if a.part in ("prepare", "all"):
            res["prepare"] = bench_prepare(work, a.prepare_mb or (4 if a.small else 20))
        if a.part in ("convert", "all"):
            res["convert"] = bench_convert(work, a.convert_mb or (40 if a.small else 400))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("(shared 2-core machine: figures are indicative)")
    print(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
