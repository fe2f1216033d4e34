"""Benchmark: read the same data from disk and from a local S3 server (moto's server mode on 127.0.0.1), side by side.

    python tests/bench/bench_storage.py            # a 100 MB JSONL (and its .gz and Parquet copies)
    python tests/bench/bench_storage.py --small    # 20 MB, a quick run
    python tests/bench/bench_storage.py --prepare  # also `prepare` end to end (tiny Llama), disk vs S3, 1 and 2 workers
    python tests/bench/bench_storage.py --outputs  # also outputs written to S3: `convert --compression none` (an
                                                   # output about the input's size) to disk and to S3, 1 and 2 workers,
                                                   # with the publishing time; `prepare` in one process disk->disk and
                                                   # S3->S3 (the per-core rate with the data in the store)

Every row runs in a fresh process (unsloth_prep.memory.run_code: peak = max(sampled RSS, ru_maxrss)) that reads every
record with `loading.iter_file` (or the second of two JSONL byte ranges, which first counts the lines before it) and
counts them; the S3 server runs in this process, so its memory is not in the figures. An S3 row's baseline holds the
S3 client (made by one HEAD before the measured part: botocore's service models are ~60 MB of its own); the last row
fetches the object in raw 8 MB ranges, the pace the server allows. Requests are counted from the server's log.
Target: a URL is read in bounded memory as a local file is (its read adds at most 32 MB more than the disk read's:
one 8 MB request buffer and the HTTP client's copies). Prints a table, then one JSON line with every figure.
"""
import argparse, gzip, json, logging, os, re, shutil, socket, sys, time
from collections import Counter
from pathlib import Path

from unsloth_prep.fixtures import write_records
from unsloth_prep.memory import MB, run_code

BUCKET = "bench-data"
SETUP = "import time\nfrom unsloth_prep.loading import file_size, iter_file, plan_shards, resolve_files\n"
WARM = "file_size({src!r})\n"       # an S3 row's baseline holds the client (botocore's models), made by one HEAD
RAW = ("t0 = time.perf_counter()\nfrom unsloth_prep.base import url_fs\nfs, p = url_fs({src!r})\n"
       "size, n, step = fs.size(p), 0, 8 << 20\n"
       "for a in range(0, size, step): n += len(fs.cat_file(p, start=a, end=min(a + step, size)))\n"
       "result = [0, time.perf_counter() - t0]")
READ = ("t0 = time.perf_counter()\nspecs = plan_shards(resolve_files({src!r}), {shards})\n"
        "n = sum(1 for s in specs[{first}:] for _ in iter_file(s, 'skip', []))\n"
        "result = [n, time.perf_counter() - t0]")


class Requests(logging.Handler):
    "Counts the S3 server's requests by method from its access log."
    def __init__(self):
        super().__init__()
        self.n = Counter()

    def emit(self, record):
        m = re.search(r"(?<![A-Z])(GET|HEAD|PUT|POST|DELETE) /", record.getMessage())   # the log line may carry colours
        if m: self.n[m.group(1)] += 1


def serve() -> tuple:
    "Start the S3 server on a free port; its environment for the measured processes; the request counter."
    from moto.server import ThreadedMotoServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    counter, log = Requests(), logging.getLogger("werkzeug")
    log.handlers[:] = [counter]
    log.setLevel(logging.INFO)
    log.propagate = False
    return server, counter


def files(d: Path, size_mb: float) -> dict:
    "The local files: a JSONL of chat records with rare huge ones, its gzip and a Parquet copy."
    import pyarrow.json as pj, pyarrow.parquet as pq
    info = write_records(d / "chat.jsonl", size_mb=size_mb, fmt="sharegpt", seed=21, huge_every=5000)
    (d / "chat.jsonl.gz").write_bytes(gzip.compress((d / "chat.jsonl").read_bytes(), compresslevel=1))
    pq.write_table(pj.read_json(d / "chat.jsonl"), d / "chat.parquet", row_group_size=2000)
    return info


def prepare_rows(d: Path, counter) -> list:
    "`unsloth-prep prepare` of the JSONL from disk and from S3, in one process and with 2 workers: its own figures."
    import subprocess
    from unsloth_prep.fixtures import tiny_model
    out = []
    for where, src in (("disk", str(d / "chat.jsonl")), ("S3", f"s3://{BUCKET}/chat.jsonl")):
        for workers in (1, 2):
            counter.n.clear()
            dst = d / f"out-{where}-{workers}"
            r = subprocess.run(["unsloth-prep", "prepare", src, "--tokenizer", str(tiny_model()), "--out", str(dst),
                                "--max-seq-length", "1024", "--workers", str(workers), "--no-progress"],
                               capture_output=True, text=True, check=True)
            s = json.loads(r.stdout.strip().splitlines()[-1])
            out.append({"case": f"prepare --workers {workers}, {where}", "records": s["records"],
                        "peak_mb": s["peak_rss_mb"], "worker_peak_mb": s.get("worker_peak_rss_mb"),
                        "seconds": s["seconds"], "requests": dict(counter.n)})
            print(f"{out[-1]['case']:<36} {s['records']:>8,} records  peak {s['peak_rss_mb']:>6.1f} MB (workers "
                  f"{s.get('worker_peak_rss_mb')})  {s['seconds']:>6.2f} s  requests {dict(counter.n)}", flush=True)
    return out


def _command(argv: list, case: str, counter) -> dict:
    "Run one command in a fresh process; its summary's figures and the server's requests."
    import subprocess
    counter.n.clear()
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    row = {"case": case, "records": s.get("records") or s.get("rows"), "rows": s["rows"], "seconds": s["seconds"],
           "publish_seconds": s.get("publish_seconds"), "peak_mb": s["peak_rss_mb"],
           "worker_peak_mb": s.get("worker_peak_rss_mb"), "output_mb": round(s.get("output_bytes", 0) / MB, 1),
           "requests": dict(counter.n)}
    print(f"{case:<44} {row['rows']:>8,} rows  {row['seconds']:>6.2f} s (publish {row['publish_seconds']} s)  peak "
          f"{row['peak_mb']:>6.1f} MB (workers {row['worker_peak_mb']})  output {row['output_mb']} MB  "
          f"requests {row['requests']}", flush=True)
    return row


def output_rows(d: Path, counter) -> list:
    "Outputs written here and to S3: `convert` (about the input's size) with 1 and 2 workers; `prepare` per core."
    from unsloth_prep.fixtures import tiny_model
    rows = []
    for workers in (1, 2):
        for where, dst in (("disk", str(d / f"conv-{workers}")), ("S3", f"s3://{BUCKET}/conv-{workers}")):
            argv = ["unsloth-prep", "convert", str(d / "chat.jsonl"), "--out", dst, "--compression", "none",
                    "--workers", str(workers), "--no-progress"]
            rows.append(_command(argv, f"convert --workers {workers} -> {where}", counter))
    for where, src, dst in (("disk -> disk", str(d / "chat.jsonl"), str(d / "prep-1")),
                            ("S3 -> S3", f"s3://{BUCKET}/chat.jsonl", f"s3://{BUCKET}/prep-1")):
        argv = ["unsloth-prep", "prepare", src, "--tokenizer", str(tiny_model()), "--out", dst, "--max-seq-length",
                "1024", "--no-progress"]
        rows.append(_command(argv, f"prepare, 1 process, {where}", counter))
        rows[-1]["records_per_s"] = round(rows[-1]["records"] / rows[-1]["seconds"], 1)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="20 MB instead of 100 MB")
    p.add_argument("--dir", default="/tmp/storage_bench")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--prepare", action="store_true", help="also time `prepare` end to end (minutes on 100 MB)")
    p.add_argument("--outputs", action="store_true", help="also write outputs to S3 (publishing time and memory)")
    a = p.parse_args(argv)
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    info = files(d, 20 if a.small else 100)
    server, counter = serve()
    import s3fs
    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    for n in ("chat.jsonl", "chat.jsonl.gz", "chat.parquet"): fs.put(str(d / n), f"{BUCKET}/{n}")
    cases = [(f"{kind}, {where}", src, shards, first)
             for kind, name, shards, first in (("JSONL", "chat.jsonl", None, 0), ("JSONL .gz", "chat.jsonl.gz", None, 0),
                                               ("Parquet", "chat.parquet", None, 0),
                                               ("JSONL, 2nd of 2 byte ranges", "chat.jsonl", 2, 1))
             for where, src in (("disk", str(d / name)), ("S3", f"s3://{BUCKET}/{name}"))]
    load = os.getloadavg()
    print(f"{info['bytes'] / MB:,.0f} MB JSONL, {info['records']:,} records; load average {load[0]:.2f}", flush=True)
    rows = []
    cases.append(("raw 8 MB GETs of the JSONL (the server's pace), S3", f"s3://{BUCKET}/chat.jsonl", None, None))
    for label, src, shards, first in cases:
        counter.n.clear()
        code = RAW.format(src=src) if first is None else READ.format(src=src, shards=shards, first=first)
        setup = SETUP + (WARM.format(src=src) if src.startswith("s3://") else "")
        r = run_code(code, label, timeout=a.timeout, setup=setup)
        (n, secs), size = r.value, os.path.getsize(d / Path(src).name)
        rows.append({"case": label, "records": n, "peak_mb": round(r.peak_mb, 1), "delta_mb": round(r.delta_mb, 1),
                     "seconds": round(secs, 2), "mb_per_s": round(size / MB / secs, 1), "requests": dict(counter.n)})
        x = rows[-1]
        print(f"{label:<36} {n:>8,} records  peak {x['peak_mb']:>6.1f} MB (+{x['delta_mb']:>5.1f})  "
              f"{secs:>6.2f} s  {x['mb_per_s']:>6.1f} MB/s (of the file)  requests {x['requests']}", flush=True)
    if a.prepare: rows += prepare_rows(d, counter)
    if a.outputs: rows += output_rows(d, counter)
    server.stop()
    reads = [r for r in rows if not r["case"].startswith(("raw", "prepare", "convert"))]
    pairs = {r["case"].rsplit(", ", 1)[0]: {} for r in reads}
    for r in reads: pairs[r["case"].rsplit(", ", 1)[0]][r["case"].rsplit(", ", 1)[1]] = r
    checks = {k: {"same_records": v["disk"]["records"] == v["S3"]["records"],
                  "delta_within_32_mb": v["S3"]["delta_mb"] <= v["disk"]["delta_mb"] + 32} for k, v in pairs.items()}
    print(json.dumps({"bytes": info["bytes"], "records": info["records"], "load_average": load[0], "rows": rows,
                      "checks": checks}))
    return 0 if all(all(c.values()) for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
