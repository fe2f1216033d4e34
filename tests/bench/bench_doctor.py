#!/usr/bin/env python
"""Benchmark of `unsloth_prep.doctor`: throughput and peak RSS in fresh processes, by file size.

  python tests/bench/bench_doctor.py [--small]

1. Raw checks (read, fields, empty answers, duplicates; no tokenizer) on generated JSONL files of two sizes with 1%
   malformed lines: the peak RSS should not grow with the file (streaming; the duplicate index is 16 bytes/record).
2. Full checks with the tiny model's tokenizer (tokenize_conversation + verify_labels + length stats) on the
   first `--sample` records of the larger file.
Prints a table, then one JSON line. Timings come from a shared machine: compare rows, not absolute numbers.
"""
import argparse, json, shutil, sys, tempfile
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="small sizes (CI smoke run)")
    a = p.parse_args(argv)
    from unsloth_prep.fixtures import tiny_model, write_records
    from unsloth_prep.memory import run_code
    sizes, sample = ((4, 16), 500) if a.small else ((32, 128), 5000)
    work = Path(tempfile.mkdtemp(prefix="bench_doctor_"))
    tiny = tiny_model()
    rows = []
    try:
        for mb in sizes:
            path = work / f"data_{mb}.jsonl"
            info = write_records(path, size_mb=mb, malformed_rate=0.01, seed=mb)
            code = (f"from unsloth_prep.doctor import doctor\nr = doctor({str(path)!r})\n"
                    "result = {'checked': r.checked, 'codes': r.codes, 'malformed': r.findings['malformed_line'].count}")
            res = run_code(code, label=f"raw {mb} MB")
            assert res.value["malformed"] == info["malformed"], (res.value, info["malformed"])
            rows.append({"case": f"raw checks, {mb} MB", "records": res.value["checked"], "seconds": round(res.seconds, 2),
                         "records_per_s": round(res.value["checked"] / res.seconds), "peak_mb": round(res.peak_mb),
                         "codes": res.value["codes"]})
        code = (f"from unsloth_prep.doctor import doctor\nr = doctor({str(path)!r}, tokenizer={str(tiny)!r}, sample={sample})\n"
                "result = {'checked': r.checked, 'codes': r.codes}")
        res = run_code(code, label="tokenizer")
        rows.append({"case": f"with tokenizer, first {sample}", "records": res.value["checked"], "seconds": round(res.seconds, 2),
                     "records_per_s": round(res.value["checked"] / res.seconds), "peak_mb": round(res.peak_mb),
                     "codes": res.value["codes"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'case':32} {'records':>9} {'seconds':>8} {'rec/s':>8} {'peak MB':>8}  codes")
    for r in rows: print(f"{r['case']:32} {r['records']:>9,} {r['seconds']:>8} {r['records_per_s']:>8,} {r['peak_mb']:>8}  {','.join(r['codes'])}")
    growth = rows[1]["peak_mb"] - rows[0]["peak_mb"]
    print(f"peak RSS growth from {sizes[0]} MB to {sizes[1]} MB of data: {growth} MB (shared, busy machine)")
    print(json.dumps({"bench": "doctor", "rows": rows, "peak_growth_mb": growth}))


if __name__ == "__main__":
    sys.exit(main())
