"""The convert benchmark's harness: the peers' one-liners, each run in a fresh process, a table and a plot of the
results, and the read-back scan. Used by `bench_convert.py` (run it as a script; nothing here is collected by pytest
and nothing in the package imports it).

    python tests/bench/bench_convert.py --small        # 20 MB files: every peer, clean and malformed, a few minutes
"""
import re, shutil, time
from pathlib import Path

import pyarrow.parquet as pq

from unsloth_prep.convert import load_parquet, parquet_files
from unsloth_prep.memory import MB, run_code


def readback_scan(path, mode: str = "mmap", cache_dir=None, column: str = "output") -> dict:
    """Touch every value of one column, reading with `mode` 'mmap' (Dataset), 'stream' (IterableDataset), 'arrow'
    (pyarrow batches) or 'table' (all in RAM)."""
    if mode == "table":
        col = pq.read_table(parquet_files(path))[column] if Path(path).is_dir() else pq.read_table(path)[column]
        return {"rows": len(col), "chars": sum(len(x or "") for x in col.to_pylist())}
    if mode == "arrow":
        rows = chars = 0
        for f in parquet_files(path):
            for b in pq.ParquetFile(f).iter_batches(batch_size=1000, columns=[column]):
                vals = b.column(0).to_pylist()
                rows += len(vals)
                chars += sum(len(x or "") for x in vals)
        return {"rows": rows, "chars": chars}
    if mode not in ("mmap", "stream"):
        raise ValueError(f"mode must be 'mmap', 'stream', 'arrow' or 'table', not {mode!r}")
    rows = chars = 0
    for b in load_parquet(path, mode == "stream", cache_dir).iter(batch_size=1000):
        rows += len(b[column])
        chars += sum(len(x or "") for x in b[column])
    return {"rows": rows, "chars": chars}

PEERS = {
    "pandas": """import pandas as pd
df = pd.read_json(SRC, lines=not ARRAY)
df.to_parquet(DST, compression="zstd", compression_level=LEVEL, use_dictionary=DICT)
result = {"rows": len(df)}""",
    "datasets": """from datasets import load_dataset
import pyarrow.parquet as pq                         # Dataset.to_parquet fixes snappy: write its table instead
ds = load_dataset("json", data_files=SRC, split="train", cache_dir=CACHE)
pq.write_table(ds.data.table, DST, compression="zstd", compression_level=LEVEL, use_dictionary=DICT)
result = {"rows": len(ds)}""",
    "pyarrow.json": """import pyarrow.json as pj, pyarrow.parquet as pq
w, n = None, 0
for b in pj.open_json(SRC):
    if w is None: w = pq.ParquetWriter(DST, b.schema, compression="zstd", compression_level=LEVEL, use_dictionary=DICT)
    w.write_batch(b); n += b.num_rows
w.close()
result = {"rows": n}""",
    "polars": """import polars as pl
if ARRAY: pl.read_json(SRC).write_parquet(DST, compression="zstd", compression_level=LEVEL)
else: pl.scan_ndjson(SRC).sink_parquet(DST, compression="zstd", compression_level=LEVEL)
result = {"rows": pl.scan_parquet(DST).select(pl.len()).collect().item()}""",
}

PEERS.update({
    "duckdb": """import duckdb
con = duckdb.connect()
opts = f"FORMAT parquet, COMPRESSION zstd, COMPRESSION_LEVEL {LEVEL}"
con.execute(f"COPY (SELECT * FROM read_json_auto('{SRC}')) TO '{DST}' ({opts})")
result = {"rows": con.execute(f"SELECT count(*) FROM read_parquet('{DST}')").fetchone()[0]}""",
    "duckdb ignore_errors": """import duckdb
con = duckdb.connect()
opts = f"FORMAT parquet, COMPRESSION zstd, COMPRESSION_LEVEL {LEVEL}"
con.execute(f"COPY (SELECT * FROM read_json_auto('{SRC}', ignore_errors=true)) TO '{DST}' ({opts})")
result = {"rows": con.execute(f"SELECT count(*) FROM read_parquet('{DST}')").fetchone()[0]}""",
    "json.loads loop": """import json, pyarrow as pa, pyarrow.parquet as pq
writer, batch, n = None, [], 0
def flush():
    global writer, batch, n
    t = pa.Table.from_pylist(batch)
    if writer is None:
        writer = pq.ParquetWriter(DST, t.schema, compression="zstd", compression_level=LEVEL, use_dictionary=DICT)
    writer.write_table(t); n += len(batch); batch = []
with open(SRC, encoding="utf-8") as f:
    for line in f:
        if not line.strip(): continue
        try: batch.append(json.loads(line))
        except json.JSONDecodeError: continue
        if len(batch) >= 10000: flush()
if batch: flush()
writer.close()
result = {"rows": n}""",
    "ours": """from unsloth_prep.convert import convert
r = convert(SRC, DST, progress=False, overwrite=True, compression_level=LEVEL, use_dictionary=DICT)
result = {"rows": r["rows"], "rejected": r["rejected"], "blank": r["blank"]}""",
    "unsloth-prep convert": """import contextlib, io, json
from unsloth_prep.cli import main              # the command as a user runs it: an output folder, default settings
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    main(["convert", SRC, "--out", DST, "--on-error", "skip", "--compression-level", str(LEVEL), "--no-progress"])
r = json.loads(buf.getvalue().strip().splitlines()[-1])
result = {"rows": r["rows"], "rejected": r["rejected"], "blank": r["blank"]}""",
})

def peer_config(m: str, level: int = 3, dictionary=True) -> str:
    "How method `m` writes Parquet in `benchmark_converters`: codec, level, dictionary."
    own = m.startswith(("polars", "duckdb", "unsloth-prep"))
    return f"zstd level {level}, dictionary " + (f"chosen by {m.split()[0]} (no option)" if own else str(dictionary))

def _last_error(msg: str) -> str:
    "The exception line of an error message (the last line naming an Error or Exception), for a table cell."
    lines = [l.strip() for l in str(msg).strip().splitlines() if l.strip()]
    named = [l for l in lines if re.match(r"^[\w.]*(Error|Exception)\b", l)]
    return ((named or lines or [str(msg)])[-1])[:140]

def _verdict(res: dict, good: int | None, bad: int) -> str:
    "What a method did with the malformed lines, from its outcome and row count."
    if res["status"] != "ok": return res["status"]
    if good is None: return "-"
    rows, rej = res["rows"], res.get("rejected")
    if rej is not None: return f"{rej} rejected with line numbers, {rows - good:+d} rows" if bad else "ok"
    if rows == good: return f"{bad} dropped silently" if bad else "ok"
    return f"{rows - good:+d} rows vs the {good} good ones" + (" (bad lines as "
                                                               "rows)" if rows > good else " (dropped silently)")

FOLDERS = {"unsloth-prep convert"}                      # methods whose output is a folder

def _remove(dst: Path):
    "Remove an output file, or an output folder (the command writes one)."
    if dst.is_dir(): shutil.rmtree(dst)
    elif dst.exists(): dst.unlink()

def _run_method(m, src, workdir, array, timeout, level=3, dictionary=True):
    "One fresh-process run of method `m` on `src`: a result dict (status 'ok' or what went wrong)."
    dst = workdir / (m.replace(' ', '_').replace('.', '_') + ("" if m in FOLDERS else ".parquet"))
    cache = workdir / "hf_cache"
    _remove(dst)
    code = (f"SRC, DST, CACHE, ARRAY = {str(src)!r}, {str(dst)!r}, {str(cache)!r}, {array!r}\n"
            f"LEVEL, DICT = {level!r}, {dictionary!r}\n" + PEERS[m] +
            "\nimport resource as _r\n_u = _r.getrusage(_r.RUSAGE_SELF)\nresult = dict(result, cpu_s=_u.ru_utime + "
            "_u.ru_stime)")
    t0 = time.perf_counter()
    try:
        r = run_code(code, label=m, timeout=timeout)
        res = dict(r.value or {}, status="ok", seconds=r.seconds, peak_mb=r.peak_mb)
    except Exception as e:
        msg = str(e)
        sig = "segfault" if "exit -11" in msg or "exit 139" in msg else None
        res = dict(status=f"crashed ({sig})" if sig else f"error: {_last_error(msg)}",
                   seconds=time.perf_counter() - t0, peak_mb=None, rows=None)
    files = sorted(dst.glob("*.parquet")) if dst.is_dir() else [dst] if dst.exists() else []
    res.update(method=m, output_mb=sum(f.stat().st_size for f in files) / MB if res["status"] == "ok" and files else None)
    _remove(dst)
    shutil.rmtree(cache, ignore_errors=True)
    return res

def benchmark_converters(src, workdir, methods=None, good_rows=None, bad_lines=0, array=False, repeat=1, timeout=3600,
                         level: int = 3, dictionary=True) -> list:
    "Convert `src` with each method in a fresh process, best of `repeat` rounds, all writing zstd `level`; a row each."
    src, workdir = Path(src), Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    size, methods = src.stat().st_size, list(methods or PEERS)
    best = {}
    for rnd in range(repeat):                       # round-robin, so a busy minute hits every method alike
        for m in methods:
            if rnd and best[m]["status"] != "ok": continue
            res = _run_method(m, src, workdir, array, timeout, level, dictionary)
            res["runs"] = best[m]["runs"] + 1 if m in best else 1
            if m not in best or (res["status"] == "ok" and res["seconds"] < best[m]["seconds"]): best[m] = res
            else: best[m]["runs"] = res["runs"]
    out = []
    for m in methods:
        res = best[m]
        res["mb_per_s"] = size / 1e6 / res["seconds"] if res["status"] == "ok" else None
        res["malformed"] = _verdict(res, good_rows, bad_lines)
        res["config"] = peer_config(m, level, dictionary)
        out.append(res)
    return out

def format_table(rows: list) -> str:
    "A markdown table of `benchmark_converters` results, with how each method was configured."
    f = lambda v, p="{:.1f}": "-" if v is None else p.format(v)
    lines = ["| method | seconds | MB/s | CPU s | peak RSS MB | output MB | rows | malformed lines | writes |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        outcome = r["malformed"] if r["status"] == "ok" else r["status"]
        lines.append(f"| {r['method']} | {f(r['seconds'])} | {f(r['mb_per_s'], '{:.0f}')} | {f(r.get('cpu_s'))} | "
                     f"{f(r['peak_mb'], '{:.0f}')} | {f(r['output_mb'])} | {f(r.get('rows'), '{:,}')} | {outcome} | "
                     f"{r.get('config', '-')} |")
    return "\n".join(lines)

def plot_benchmark(rows: list, title: str = ""):
    "Bars of seconds and peak RSS per method (failed methods are left empty)."
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3), dpi=80)
    names = [r["method"] for r in rows]
    for ax, key, label in ((a1, "seconds", "seconds"), (a2, "peak_mb", "peak RSS (MB)")):
        vals = [r[key] if r["status"] == "ok" else 0 for r in rows]
        ax.barh(names, vals, color=["tab:green" if n == "ours" else "tab:gray" for n in names])
        ax.set_xlabel(label)
        ax.invert_yaxis()
        for i, r in enumerate(rows):
            if r["status"] != "ok": ax.text(0, i, " failed", va="center", fontsize=8, color="tab:red")
    a2.set_yticklabels([])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
