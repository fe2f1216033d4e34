#!/usr/bin/env python
"""Benchmark of `unsloth_prep.pretrain.prepare_pretrain` against the common in-memory recipe.

  python tests/bench/bench_pretrain.py [--mb 40] [--block-size 1024] [--small]

The common recipe (transformers' run_clm example, done in memory as many notebooks do): read every document,
`tokenizer(texts)` with EOS appended, `group_texts` (concatenate everything, cut blocks of block_size, drop the
remainder, labels = input_ids), write Parquet. Ours: `prepare_pretrain` (streamed, position ids per document), once
with the recipe's imports (transformers pulls in torch) and once with only its own (tokenizers, pyarrow, numpy).
Each runs in a fresh process with the same imports (a third process runs the imports only: the baseline both share);
peak RSS is measured from outside (unsloth_prep.memory.run_code).
Then the two outputs are compared: the same input_ids block for block. Target: ours' peak RSS stays flat as the
corpus grows and is well below the recipe's. Prints a table, then one JSON line.
"""
import argparse, json, sys, tempfile, time
from pathlib import Path

IMPORTS = """
import json, itertools
import numpy, pyarrow as pa, pyarrow.parquet as pq, tokenizers, transformers
from transformers import AutoTokenizer
from unsloth_prep.pretrain import prepare_pretrain
"""

OURS = IMPORTS + """
r = prepare_pretrain({data!r}, {model!r}, {out!r}, {block_size})
result = {{"blocks": r["blocks"], "tokens": r["tokens"], "dropped": r["dropped_tokens"]}}
"""

LEAN = """
from unsloth_prep.pretrain import prepare_pretrain
r = prepare_pretrain({data!r}, {model!r}, {out!r}, {block_size})
result = {{"blocks": r["blocks"], "tokens": r["tokens"]}}
"""

RECIPE = IMPORTS + """
tok = AutoTokenizer.from_pretrained({model!r})
texts = [json.loads(line)["text"] + tok.eos_token for line in open({data!r}, encoding="utf-8")]
enc = tok(texts)
def group_texts(examples, block_size={block_size}):
    concatenated = {{k: list(itertools.chain(*examples[k])) for k in examples.keys()}}
    total = (len(concatenated["input_ids"]) // block_size) * block_size
    result = {{k: [t[i:i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}}
    result["labels"] = result["input_ids"].copy()
    return result
blocks = group_texts(dict(enc))
pq.write_table(pa.table({{k: blocks[k] for k in ("input_ids", "labels")}}), {out!r})
result = {{"blocks": len(blocks["input_ids"]), "tokens": sum(len(x) for x in enc["input_ids"])}}
"""


def measure(data, model, block_size, d):
    "Peak RSS and seconds of both preparations on one corpus, and whether their blocks are the same ids."
    import pyarrow.parquet as pq
    from unsloth_prep.memory import run_code
    runs = {}
    for name, code in (("imports only", IMPORTS), ("ours", OURS), ("ours, own imports", LEAN),
                       ("common recipe", RECIPE)):
        out = str(d / f"{name.replace(' ', '_')}.parquet")
        runs[name] = run_code(code.format(data=str(data), model=str(model), out=out, block_size=block_size), name)
    a = pq.read_table(d / "ours.parquet", columns=["input_ids"]).column(0)
    b = pq.read_table(d / "common_recipe.parquet", columns=["input_ids"]).column(0)
    return runs, len(a) == len(b) and a.equals(b.cast(a.type))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, nargs="+", default=[10, 40], help="corpus sizes in MB (one run each)")
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--small", action="store_true", help="2 and 5 MB only")
    args = p.parse_args(argv)
    from unsloth_prep.fixtures import iter_corpus, tiny_model
    model, sizes = tiny_model(), ([2, 5] if args.small else args.mb)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for mb in sizes:
            data = d / f"corpus_{mb}.jsonl"
            with open(data, "w", encoding="utf-8") as f:
                for doc in iter_corpus(seed=1):
                    f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                    if f.tell() >= mb * 2**20: break
            runs, same = measure(data, model, args.block_size, d)
            o, r, base = runs["ours"], runs["common recipe"], runs["imports only"].peak_mb
            rows.append({"mb": mb, "tokens": o.value["tokens"], "blocks": o.value["blocks"], "same_ids": same,
                         "imports_peak_mb": round(base), "ours_peak_mb": round(o.peak_mb),
                         "recipe_peak_mb": round(r.peak_mb), "ours_above_imports_mb": round(o.peak_mb - base),
                         "recipe_above_imports_mb": round(r.peak_mb - base),
                         "ours_own_imports_peak_mb": round(runs["ours, own imports"].peak_mb),
                         "ours_s": round(o.seconds, 1), "recipe_s": round(r.seconds, 1),
                         "above_imports_ratio": round((r.peak_mb - base) / max(1.0, o.peak_mb - base), 1)})
    print(f"{'MB':>6} {'tokens':>11} {'blocks':>7} {'same ids':>8} {'imports MB':>10} {'ours MB':>8} "
          f"{'recipe MB':>9} {'ours alone MB':>13} {'ours s':>7} {'recipe s':>8}")
    for x in rows:
        print(f"{x['mb']:>6} {x['tokens']:>11,} {x['blocks']:>7,} {str(x['same_ids']):>8} {x['imports_peak_mb']:>10} "
              f"{x['ours_peak_mb']:>8} {x['recipe_peak_mb']:>9} {x['ours_own_imports_peak_mb']:>13} {x['ours_s']:>7} "
              f"{x['recipe_s']:>8}")
    print(json.dumps({"block_size": args.block_size, "runs": rows}))
    ok = all(x["same_ids"] for x in rows) and rows[-1]["ours_peak_mb"] < rows[-1]["recipe_peak_mb"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
