#!/usr/bin/env python
"""Benchmark of unsloth_prep.collators packing against TRL's pack_dataset(strategy="bfd").

  python tests/bench/bench_collators.py [--small]

1. Token efficiency (real tokens / row capacity) on generated chat data tokenized with the tiny model's template, for
   several max_seq_length: ours (whole dataset), TRL whole dataset (map batch = dataset), TRL default (map batches of
   1,000 rows), and our streaming packer. Target: ours >= 99% and >= TRL.
2. Speed on 1M example lengths drawn from that data: our BFD on the lengths alone (target < 2 s), our pack_table and
   TRL's _pack_bfd on the same Arrow table (int8 tokens so that the table fits), and the ratio.
Prints a table, then one JSON line.
"""
import argparse, json, sys, time

import numpy as np
import pyarrow as pa


def chat_lengths_and_rows(n, seed=0):
    """Tokenized chat rows (input_ids, labels) from the fixtures generator and the tiny model's chat template."""
    from transformers import AutoTokenizer
    from unsloth_prep.fixtures import iter_records, tiny_model
    tok = AutoTokenizer.from_pretrained(tiny_model())
    rows = []
    convs = [r["messages"] for r in iter_records(n, fmt="openai", seed=seed)]
    for a in range(0, n, 2000):
        part = convs[a:a + 2000]
        full = tok(tok.apply_chat_template(part, tokenize=False), add_special_tokens=False)["input_ids"]
        prompts = tok(tok.apply_chat_template([c[:-1] for c in part], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
        rows += [{"input_ids": f, "labels": [-100] * len(p) + f[len(p):]} for f, p in zip(full, prompts)]
    return rows


def efficiency_table(rows, seq_lengths):
    """Efficiency of each packer per max_seq_length on the same rows (overlong rows removed first, for everyone)."""
    import datasets
    from trl import pack_dataset as trl_pack
    from unsloth_prep.collators import pack_dataset, pack_stream
    out = []
    for L in seq_lengths:
        keep = [r for r in rows if len(r["input_ids"]) <= L]
        tokens = sum(len(r["input_ids"]) for r in keep)
        ds = datasets.Dataset.from_list(keep)
        eff = lambda n_rows: tokens / (n_rows * L)
        t = time.perf_counter(); ours = pack_dataset(ds, L); t_ours = time.perf_counter() - t
        t = time.perf_counter(); trl_whole = trl_pack(ds, L, strategy="bfd", map_kwargs={"batch_size": len(ds)}); t_trl = time.perf_counter() - t
        trl_default = trl_pack(ds, L, strategy="bfd")
        st = {}
        sum(1 for _ in pack_stream(iter(keep), L, buffer_size=1000, stats=st))
        out.append({"max_seq_length": L, "examples": len(keep), "tokens": tokens,
                    "ours": eff(len(ours)), "trl_whole": eff(len(trl_whole)), "trl_default": eff(len(trl_default)),
                    "ours_stream_1000": st["efficiency"], "ours_s": t_ours, "trl_whole_s": t_trl})
    return out


def trl_bfd_lengths(lengths, L):
    """TRL 1.15's BFD loop from `_pack_bfd` (its `_SegmentTree`, same steps) on bare lengths; returns the number of rows."""
    from collections import defaultdict, deque
    from trl.data_utils import _SegmentTree
    tree = _SegmentTree(L); tree.add(L)
    space_to_bin, bins = defaultdict(deque), []
    for length in np.sort(lengths)[::-1].tolist():
        space = tree.search(length)
        if space < L: b = space_to_bin[space].popleft()
        else: b = {"length": 0}; bins.append(b)
        b["length"] += length
        if space < L and not space_to_bin[space]: tree.remove(space)
        space -= length
        space_to_bin[space].append(b)
        if space > 0: tree.add(space)
    return len(bins)


def speed(lengths_pool, n, L, seed=0):
    """Seconds for 1M-scale packing: lengths only (ours), and a full Arrow table (ours vs TRL's _pack_bfd)."""
    from trl.data_utils import _pack_bfd
    from unsloth_prep.collators import pack_lengths, pack_table
    rng = np.random.default_rng(seed)
    lens = rng.choice(lengths_pool[lengths_pool <= L], n)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter(); plan = pack_lengths(lens, L); best = min(best, time.perf_counter() - t)
    t = time.perf_counter(); trl_rows = trl_bfd_lengths(lens, L); t_trl_len = time.perf_counter() - t
    assert trl_rows == plan.n_rows, (trl_rows, plan.n_rows)
    off = np.r_[0, np.cumsum(lens)].astype(np.int64)
    table = pa.table({"input_ids": pa.LargeListArray.from_arrays(pa.array(off), pa.array(np.zeros(off[-1], np.int8)))})
    t = time.perf_counter(); ours, st = pack_table(table, L); t_table = time.perf_counter() - t
    t = time.perf_counter(); theirs = _pack_bfd(table, L); t_trl = time.perf_counter() - t
    assert ours.num_rows == theirs.num_rows == plan.n_rows, (ours.num_rows, theirs.num_rows, plan.n_rows)
    return {"examples": n, "max_seq_length": L, "tokens": int(off[-1]), "rows": plan.n_rows, "efficiency": plan.efficiency,
            "ours_lengths_s": best, "trl_lengths_s": t_trl_len, "trl_over_ours_lengths": t_trl_len / best, "ours_table_s": t_table, "trl_table_s": t_trl, "trl_over_ours_table": t_trl / t_table}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="3k chat rows and 100k lengths (about a minute)")
    a = p.parse_args(argv)
    n_rows, n_lengths = (3_000, 100_000) if a.small else (20_000, 1_000_000)
    t0 = time.perf_counter()
    rows = chat_lengths_and_rows(n_rows)
    lengths = np.array([len(r["input_ids"]) for r in rows])
    print(f"{n_rows} generated chat rows tokenized in {time.perf_counter() - t0:.1f} s; tokens per row median "
          f"{np.median(lengths):.0f}, p95 {np.percentile(lengths, 95):.0f}, max {lengths.max()}")
    eff = efficiency_table(rows, (1024, 2048, 4096))
    print(f"\n{'max_len':>7s} {'examples':>8s} {'ours':>8s} {'TRL whole':>9s} {'TRL default':>11s} {'ours stream':>11s} {'ours s':>7s} {'TRL s':>7s}")
    for r in eff:
        print(f"{r['max_seq_length']:7d} {r['examples']:8d} {100 * r['ours']:7.2f}% {100 * r['trl_whole']:8.2f}% "
              f"{100 * r['trl_default']:10.2f}% {100 * r['ours_stream_1000']:10.2f}% {r['ours_s']:7.2f} {r['trl_whole_s']:7.2f}")
    sp = speed(lengths, n_lengths, 2048)
    print(f"\n{sp['examples']:,} lengths ({sp['tokens']:,} tokens) into {sp['rows']:,} rows of {sp['max_seq_length']} "
          f"(efficiency {100 * sp['efficiency']:.3f}%):")
    print(f"  ours, lengths only (best of 3)   {sp['ours_lengths_s']:.3f} s   target < 2 s")
    print(f"  TRL's BFD loop, lengths only     {sp['trl_lengths_s']:.3f} s   ({sp['trl_over_ours_lengths']:.0f}x ours)")
    print(f"  ours, pack_table (Arrow)         {sp['ours_table_s']:.3f} s")
    print(f"  TRL _pack_bfd, same table        {sp['trl_table_s']:.3f} s   ({sp['trl_over_ours_table']:.1f}x ours)")
    targets = {"efficiency_ge_99": all(r["ours"] >= 0.99 for r in eff),
               "efficiency_ge_trl": all(r["ours"] >= r["trl_whole"] - 1e-12 and r["ours"] >= r["trl_default"] for r in eff),
               "lengths_under_2s": sp["ours_lengths_s"] < 2.0}
    print("\ntargets:", targets, "(timings on a shared, busy 2-core machine)")
    print(json.dumps({"small": a.small, "efficiency": eff, "speed": sp, "targets": targets}))
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
