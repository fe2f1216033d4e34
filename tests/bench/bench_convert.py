#!/usr/bin/env python
"""Benchmark: JSONL / JSON array -> Parquet, our converter against the usual peers, same files, fresh process each.

    flock /tmp/heavy.lock python tests/bench/bench_convert.py            # 300 MB + 1 GB (pandas needs ~7 GB RAM)
    python tests/bench/bench_convert.py --sizes 300 --only "ours,unsloth-prep convert,pyarrow.json" --skip malformed,array
    python tests/bench/bench_convert.py --small                          # 20 MB files, a minute
    python tests/bench/bench_convert.py --dirty --sizes 300              # clean vs 0.1% vs 1% bad lines, same size
    python tests/bench/bench_convert.py --readback --sizes 100           # the output read back four ways

--dirty: one clean file and two copies with 0.1% and 1% bad lines inserted (same size in bytes), the bad lines of
twelve kinds in turn: six the line scan sees (truncated, trailing text, not JSON, null, two objects, an open quote)
and six only a JSON parser sees (`tru`, a trailing comma, a bad escape, a missing colon, an unquoted key, `NaN`).
Our converter only (and `--baseline DIR` beside it), fresh process each, best of --repeat; the target: >= 0.85x
the clean speed at 1%.

Files (generated Alpaca JSONL, Chinese + English, long-tailed, a few 200k-character records):
  malformed: 0.1% malformed lines (every kind the fixtures make); clean: none; array: the clean records as a JSON array.
Prints one markdown table per file, then the target checks, then everything as one JSON line.
"""
import argparse, json, os, shutil, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_harness import PEERS, benchmark_converters, format_table, peer_config
from unsloth_prep.convert import convert
from unsloth_prep.fixtures import write_records
from unsloth_prep.memory import run_code

ALL = ["pandas", "datasets", "pyarrow.json", "polars", "duckdb", "duckdb ignore_errors", "json.loads loop", "ours",
       "unsloth-prep convert"]
ARRAY_PEERS = ["duckdb", "polars", "ours", "ours (baseline)"]


def make(path, size_mb, malformed, layout="jsonl"):
    "Generate one input file (cached by name) and return the write_records info."
    meta = Path(str(path) + ".info.json")
    if path.exists() and meta.exists(): return json.loads(meta.read_text())
    info = write_records(path, size_mb=size_mb, malformed_rate=malformed, huge_every=100_000, layout=layout, seed=11)
    info.pop("malformed_lines", None)
    meta.write_text(json.dumps(info))
    return info


def run(name, path, info, methods, work, array=False, repeat=1, level=3, dictionary=True):
    "Benchmark one file and print its table."
    good = info["records"]
    t = time.time()
    rows = benchmark_converters(path, work / name, methods=methods, good_rows=good, bad_lines=info.get("malformed", 0),
                                array=array, repeat=repeat, level=level, dictionary=dictionary)
    size = Path(path).stat().st_size / 1e6
    print(f"\n### {name}: {size:,.0f} MB, {info['lines'] if 'lines' in info else good:,} lines, {info.get('malformed', 0)} malformed "
          f"({time.time() - t:.0f} s for the table)\n")
    print(format_table(rows), flush=True)
    return {"file": name, "mb": size, "records": good, "malformed": info.get("malformed", 0), "results": rows}


def best(results, method):
    "The result row of a method, or None."
    return next((r for r in results["results"] if r["method"] == method and r["status"] == "ok"), None)


def checks(out):
    "The issue's targets, evaluated on this run."
    lines, by = [], {o["file"]: o for o in out}
    clean = [k for k in by if k.startswith("clean")]
    big = max(clean, key=lambda k: by[k]["mb"]) if clean else None
    if big:
        ours = best(by[big], "ours")
        peers = [r for r in by[big]["results"] if r["status"] == "ok" and r["method"] not in ("ours", "unsloth-prep convert")]
        if ours and peers:
            fastest = max(peers, key=lambda r: r["mb_per_s"])
            lines.append(f"clean {big}: ours {ours['mb_per_s']:.0f} MB/s at {ours['peak_mb']:.0f} MB; fastest peer {fastest['method']} "
                         f"{fastest['mb_per_s']:.0f} MB/s at {fastest['peak_mb']:.0f} MB -> {ours['mb_per_s'] / fastest['mb_per_s']:.2f}x "
                         f"(target >= 0.90x), RSS {'<=' if ours['peak_mb'] <= fastest['peak_mb'] else '>'} peer's")
            if ours.get("cpu_s") and fastest.get("cpu_s"):
                lines.append(f"  CPU seconds (all threads): ours {ours['cpu_s']:.1f}, {fastest['method']} {fastest['cpu_s']:.1f}")
            pj = best(by[big], "pyarrow.json")
            for name, o in (("ours", ours), ("unsloth-prep convert", best(by[big], "unsloth-prep convert"))):
                if pj and o: lines.append(f"  {name} / pyarrow.json: speed {o['mb_per_s'] / pj['mb_per_s']:.2f}x (target "
                                          f">= 1.1x), CPU {pj['cpu_s'] / o['cpu_s']:.2f}x, peak RSS "
                                          f"{o['peak_mb'] / pj['peak_mb']:.2f}x")
            for m in ("polars", "duckdb", "datasets"):
                r = best(by[big], m)
                if r: lines.append(f"  ours / {m}: {ours['mb_per_s'] / r['mb_per_s']:.2f}x (target >= 1.5x)")
    for k in by:
        if k.startswith("malformed"):
            twin = "clean" + k[len("malformed"):]
            a, b = best(by[k], "ours"), best(by.get(twin, {"results": []}), "ours")
            if a and b:
                lines.append(f"{k}: ours {a['mb_per_s']:.0f} MB/s vs clean {b['mb_per_s']:.0f} MB/s -> {a['mb_per_s'] / b['mb_per_s']:.2f}x (target >= 0.85x)"
                             + (f"; CPU s {a['cpu_s']:.1f} vs {b['cpu_s']:.1f} -> {b['cpu_s'] / a['cpu_s']:.2f}x" if a.get("cpu_s") and b.get("cpu_s") else ""))
    peaks = {k: best(by[k], "ours")["peak_mb"] for k in by if best(by[k], "ours")}
    if peaks:
        lines.append("ours peak RSS per file (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()) +
                     f"; max/min {max(peaks.values()) / min(peaks.values()):.2f} (target <= 1.25), max {max(peaks.values()):.0f} (target < 256)")
    return lines


DIRTY_KINDS = ["truncated", "trailing", "bare", "null", "two_objects", "quote",
               "bad_literal", "trailing_comma", "bad_escape", "missing_colon", "unquoted_key", "nan"]


def bad_line(kind, good):
    "A bad line of `kind` made from the good JSON line `good`."
    g = good.rstrip("\n")
    return {"truncated": g[: max(2, len(g) // 2)], "trailing": g + " xyz", "bare": "this is not json", "null": "null",
            "two_objects": g + g, "quote": '{"instruction": "unterminated}',
            "bad_literal": g[:-1] + ', "flag": tru}', "trailing_comma": g[:-1] + ",}",
            "bad_escape": '{"instruction": "a\\x41", ' + g[1:], "missing_colon": '{"instruction" "q", ' + g[1:],
            "unquoted_key": '{instruction: "q", ' + g[1:], "nan": g[:-1] + ', "score": NaN}'}[kind]


def make_dirty(clean, out, rate, seed=3):
    "Copy `clean` with bad lines inserted at `rate`, cut at the clean file's size; return the write_records-like info."
    import random
    rng, size, k, good, lines = random.Random(seed), 0, 0, 0, 0
    limit = os.path.getsize(clean)
    with open(clean, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
        for line in f:
            if rng.random() < rate:
                b = bad_line(DIRTY_KINDS[k % len(DIRTY_KINDS)], line) + "\n"
                o.write(b)
                size, k, lines = size + len(b.encode()), k + 1, lines + 1
            o.write(line)
            size, good, lines = size + len(line.encode()), good + 1, lines + 1
            if size >= limit: break
    return {"records": good, "malformed": k, "lines": lines}


def dirty(a, work):
    "Clean vs 0.1% vs 1% bad lines, same size: our converter's speed, slow blocks and rejects."
    mb = int(a.sizes.split(",")[0]) if not a.small else 20
    clean = work / f"clean_{mb}MB.jsonl"
    infos = {"clean": make(clean, mb, 0.0)}
    files = {"clean": clean}
    for rate, name in ((0.001, "0.1%"), (0.01, "1%")):
        files[name] = work / f"dirty_{name[:-1]}_{mb}MB.jsonl"
        infos[name] = make_dirty(clean, files[name], rate)
    for m in ("ours", "ours (baseline)"):                     # report the slow blocks too
        if m in PEERS: PEERS[m] = PEERS[m].replace('"blank": r["blank"]}', '"blank": r["blank"], "slow_blocks": r["slow_blocks"]}')
    methods = ["ours"] + (["ours (baseline)"] if a.baseline else [])
    res = {}
    for _ in range(a.repeat):              # files interleaved round by round, so a busy minute hits each alike
        for k in files:
            rows = benchmark_converters(files[k], work / "dirty_out", methods=methods, good_rows=infos[k]["records"],
                                        bad_lines=infos[k].get("malformed", 0), repeat=1)
            res[k] = [r if k not in res or r["status"] != "ok" or r["seconds"] < o["seconds"] else o
                      for r, o in zip(rows, res.get(k, rows))]
    print(f"\n### dirty data, {mb} MB each (best of {a.repeat}, fresh process each)\n")
    print("| method | file | MB | bad lines | rejected | slow blocks | seconds | MB/s | CPU s | x clean (MB/s) | x clean (CPU) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        base = next(r for r in res["clean"] if r["method"] == m)
        for k in files:
            r = next(x for x in res[k] if x["method"] == m)
            if r["status"] != "ok":
                print(f"| {m} | {k} | | | | | {r['status']} | | | | |")
                continue
            print(f"| {m} | {k} | {files[k].stat().st_size / 1e6:,.0f} | {infos[k].get('malformed', 0):,} | "
                  f"{r.get('rejected', '-')} | {r.get('slow_blocks', '-')} | {r['seconds']:.2f} | {r['mb_per_s']:.0f} | "
                  f"{r['cpu_s']:.2f} | {r['mb_per_s'] / base['mb_per_s']:.2f} | {base['cpu_s'] / r['cpu_s']:.2f} |")
    one = next(x for x in res["1%"] if x["method"] == "ours")
    cl = next(x for x in res["clean"] if x["method"] == "ours")
    print(f"\ntarget: 1% bad lines at >= 0.85x the clean speed: {one['mb_per_s'] / cl['mb_per_s']:.2f}x "
          f"(CPU seconds: {cl['cpu_s'] / one['cpu_s']:.2f}x)")
    print(json.dumps(res, default=str))


def readback(a, work):
    "The converted file read back four ways, each in a fresh process: seconds and peak RSS."
    mb = 20 if a.small else int(a.sizes.split(",")[0])
    src = work / f"clean_{mb}MB.jsonl"
    make(src, mb, 0.0)
    out = work / "readback.parquet"
    convert(src, out, overwrite=True, progress=False)
    here = str(Path(__file__).resolve().parent)
    print(f"\n### reading back {out.stat().st_size / 1e6:.0f} MB of Parquet ({mb} MB of JSONL), fresh process each\n")
    print("| way | seconds | peak RSS MB |\n|---|---:|---:|")
    for mode, label in (("table", "pq.read_table (all in RAM)"), ("mmap", "Dataset, memory-mapped"),
                        ("stream", "IterableDataset, streaming"), ("arrow", "pyarrow batches of 1000")):
        r = run_code(f"import sys; sys.path.insert(0, {here!r})\nfrom convert_harness import readback_scan\n"
                     f"result = readback_scan({str(out)!r}, {mode!r}, {str(work / 'hf_rb')!r})", label=label)
        print(f"| {label} | {r.seconds:.1f} | {r.peak_mb:.0f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="20 MB files (notebook-sized)")
    ap.add_argument("--sizes", default="300,1024", help="MB sizes of the JSONL files (default 300,1024)")
    ap.add_argument("--dir", default="/tmp/convert/bench", help="where the generated files and outputs go")
    ap.add_argument("--keep", action="store_true", help="keep the generated inputs")
    ap.add_argument("--only", default=None, help="comma-separated methods")
    ap.add_argument("--skip", default="", help="comma-separated file kinds to skip: clean,malformed,array")
    ap.add_argument("--repeat", type=int, default=2, help="rounds per file (round-robin over methods; best time kept)")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also run 'ours' from another copy of the package (a folder holding unsloth_prep/), "
                         "e.g. `git archive COMMIT unsloth_prep | tar -x -C DIR`: before/after on the same file")
    ap.add_argument("--zstd-level", type=int, default=3, help="zstd level every method writes with (default 3)")
    ap.add_argument("--dictionary", default="true", choices=("true", "false"),
                    help="dictionary encoding for every writer that has the option (default true, pyarrow's default)")
    ap.add_argument("--dirty", action="store_true", help="clean vs 0.1%% vs 1%% bad lines (first of --sizes)")
    ap.add_argument("--readback", action="store_true", help="the output read back four ways (first of --sizes)")
    a = ap.parse_args()
    import compileall, unsloth_prep         # bytecode ready, as a wheel install leaves it (the peers' already is)
    compileall.compile_dir(str(Path(unsloth_prep.__file__).parent), quiet=1)
    work = Path(a.dir); work.mkdir(parents=True, exist_ok=True)
    sizes = [20] if a.small else [int(s) for s in a.sizes.split(",")]
    methods = a.only.split(",") if a.only else ALL
    if a.baseline:
        PEERS["ours (baseline)"] = (f"import sys; sys.path.insert(0, {str(Path(a.baseline).resolve())!r})\n"
                                    "for _m in [m for m in sys.modules if m.split('.')[0] == 'unsloth_prep']: "
                                    "del sys.modules[_m]\n" + PEERS["ours"])   # the runner imported ours already
        methods = methods + ["ours (baseline)"]
    if a.dirty: return dirty(a, work)
    if a.readback: return readback(a, work)
    skip, out = set(a.skip.split(",")), []
    cfg = dict(repeat=a.repeat, level=a.zstd_level, dictionary=a.dictionary == "true")
    print("every method: best of", a.repeat, "round(s), fresh process each; writers configured as:")
    for m in methods: print(f"  {m}: {peer_config(m, cfg['level'], cfg['dictionary'])}")
    for mb in sizes:
        tag = f"{mb}MB" if mb < 1024 else f"{mb // 1024}GB"
        if "malformed" not in skip:
            p = work / f"malformed_{tag}.jsonl"; info = make(p, mb, 0.001)
            out.append(run(f"malformed_{tag}", p, info, methods, work, **cfg))
        if "clean" not in skip:
            p = work / f"clean_{tag}.jsonl"; info = make(p, mb, 0.0)
            out.append(run(f"clean_{tag}", p, info, methods, work, **cfg))
    if "array" not in skip:
        mb = sizes[-1]; tag = f"{mb}MB" if mb < 1024 else f"{mb // 1024}GB"
        p = work / f"array_{tag}.json"; info = make(p, mb, 0.0, layout="json_array")
        out.append(run(f"array_{tag}", p, info, [m for m in methods if m in ARRAY_PEERS], work, array=True, **cfg))
    print("\n### targets\n")
    for line in checks(out): print(line)
    print(f"\nTimings on a shared 2-core machine that other jobs were using; best of {a.repeat} round(s) per method.")
    print(json.dumps(out, default=str))
    if not a.keep:
        for p in work.glob("*.json*"): p.unlink()


if __name__ == "__main__":
    main()
