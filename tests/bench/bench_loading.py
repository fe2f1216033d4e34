"""Benchmark: stream a generated JSONL and the same records as a JSON array end to end, next to load_dataset("json").

    python tests/bench/bench_loading.py            # 1 GB files (wrap in `flock /tmp/heavy.lock` on a shared box)
    python tests/bench/bench_loading.py --small    # 20 MB files, a quick run

Every row runs in a fresh process (unsloth_prep.memory.run_code: peak = max(sampled RSS, ru_maxrss)).
Targets (issue 3): our stream of the JSONL and of the JSON array each peak under 300 MB and within 20% of each other.
Prints a table, then one JSON line with every figure and the target checks.
"""
import argparse, json, os, shutil, sys, time
from pathlib import Path

import psutil

from unsloth_prep.fixtures import write_records
from unsloth_prep.memory import MB, run_code

NO_TORCH = "import os; os.environ['USE_TORCH'] = '0'\n"


def rows(jsonl: str, array: str, cache: str) -> dict:
    "label -> Python source measured in a fresh process; each assigns the record count to `result`."
    hf = f"import os; os.environ['HF_DATASETS_CACHE'] = {cache!r}; os.environ['HF_DATASETS_OFFLINE'] = '1'\nfrom datasets import load_dataset\n"
    readers = ("from unsloth_prep.loading import iter_jsonl, iter_json_array, normalize_record\n"
               "result = sum(1 for _, r in {it}({path!r}) if normalize_record(r, 'alpaca'))")
    conv = "from unsloth_prep.loading import load_conversations\nresult = sum(1 for _ in load_conversations({path!r}))"
    ld = "ds = load_dataset('json', data_files={path!r}, split='train'{kw})\nresult = sum(1 for _ in ds)"
    return {
        "ours readers, JSONL": readers.format(it="iter_jsonl", path=jsonl),
        "ours readers, JSON array": readers.format(it="iter_json_array", path=array),
        "ours load_conversations, JSONL (USE_TORCH=0)": NO_TORCH + conv.format(path=jsonl),
        "ours load_conversations, JSON array (USE_TORCH=0)": NO_TORCH + conv.format(path=array),
        "ours load_conversations, JSONL (torch installed)": conv.format(path=jsonl),
        "ours load_conversations, JSON array (torch installed)": conv.format(path=array),
        "imports only: IterableDataset created (torch installed)": "from unsloth_prep.loading import load_stream\n"
                                                                    f"ds = load_stream({jsonl!r}); result = -1",
        "load_dataset('json') JSONL": hf + ld.format(path=jsonl, kw=""),
        "load_dataset('json', streaming=True) JSONL": hf + ld.format(path=jsonl, kw=", streaming=True"),
        "load_dataset('json') JSON array": hf + ld.format(path=array, kw=""),
        "load_dataset('json', streaming=True) JSON array": hf + ld.format(path=array, kw=", streaming=True"),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="20 MB files instead of 1 GB")
    p.add_argument("--size-mb", type=float, default=None)
    p.add_argument("--dir", default="/tmp/loading/bench")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args(argv)
    size = a.size_mb or (20 if a.small else 1024)
    d = Path(a.dir); d.mkdir(parents=True, exist_ok=True)
    cache = d / "hf_cache"
    t0 = time.perf_counter()
    j = write_records(d / "bench.jsonl", size_mb=size, fmt="alpaca", seed=21, huge_every=5000)
    arr = write_records(d / "bench.json", n=j["records"], fmt="alpaca", seed=21, huge_every=5000, layout="json_array")
    print(f"generated {j['bytes'] / MB:,.0f} MB JSONL and {arr['bytes'] / MB:,.0f} MB JSON array, {j['records']:,} records "
          f"(every 5,000th with a 200k-character answer) in {time.perf_counter() - t0:.0f} s", flush=True)
    results = []
    for label, code in rows(str(d / "bench.jsonl"), str(d / "bench.json"), str(cache)).items():
        need = (6 if "load_dataset('json') JSON" in label or "JSON array" in label and "load_dataset" in label else 1) * arr["bytes"] / MB + 1500
        avail = psutil.virtual_memory().available / MB
        if "load_dataset" in label and avail < need:
            results.append({"label": label, "error": f"skipped: {avail:,.0f} MB available < {need:,.0f} MB needed"}); print(label, "skipped"); continue
        try:
            r = run_code(code, label=label, timeout=a.timeout)
            row = {"label": label, "records": r.value, "peak_mb": round(r.peak_mb, 1), "seconds": round(r.seconds, 1),
                   "mb_per_s": round(j["bytes"] / MB / r.seconds, 1) if r.seconds else None}
        except Exception as e:  # a crash (e.g. pyarrow) or a timeout is a result too
            row = {"label": label, "error": str(e)[-300:]}
        results.append(row)
        print(f"  {label:58s} " + (f"{row['peak_mb']:9,.0f} MB {row['seconds']:7.1f} s" if "peak_mb" in row else row["error"][:120]), flush=True)
        shutil.rmtree(cache, ignore_errors=True)
    by = {r["label"]: r for r in results}
    jl, ar = by["ours load_conversations, JSONL (USE_TORCH=0)"], by["ours load_conversations, JSON array (USE_TORCH=0)"]
    checks = {}
    if "peak_mb" in jl and "peak_mb" in ar:
        checks = {"jsonl_peak_under_300": jl["peak_mb"] < 300, "array_peak_under_300": ar["peak_mb"] < 300,
                  "within_20pct": abs(jl["peak_mb"] - ar["peak_mb"]) / max(jl["peak_mb"], ar["peak_mb"]) < 0.2,
                  "all_records": jl["records"] == ar["records"] == j["records"]}
    print(f"\n| {'technique (fresh process each)':58s} | records | peak RSS MB | seconds | MB/s |")
    print(f"|{'-' * 60}|---------|-------------|---------|------|")
    for r in results:
        if "peak_mb" in r: print(f"| {r['label']:58s} | {r['records']:>7,} | {r['peak_mb']:>11,.0f} | {r['seconds']:>7.1f} | {r['mb_per_s'] or 0:>4.0f} |")
        else: print(f"| {r['label']:58s} | {'-':>7} | {r['error'][:60]} |")
    print("\ntargets:", checks, f"(machine: {os.cpu_count()} CPUs, shared with other jobs; timings are indicative)")
    summary = {"bench": "loading", "size_mb": round(j["bytes"] / MB, 1), "records": j["records"], "rows": results, "targets": checks,
               "targets_met": bool(checks) and all(checks.values())}
    if not a.keep:
        for f in ("bench.jsonl", "bench.json"): (d / f).unlink(missing_ok=True)
    print(json.dumps(summary))
    return 0 if summary["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
