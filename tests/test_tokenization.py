"""`unsloth-prep stats` / `prepare` in fresh processes, bounded memory on big inputs, and tokenize_dataset on streams."""
import json, subprocess, sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from unsloth_prep.fixtures import iter_records, tiny_model, write_records
from unsloth_prep.tokenization import (TokenizeCounts, length_stats, load_tokenizer, tokenize_conversation,
                                       tokenize_dataset, verify_labels)
from clitools import last_json, run


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def tok(model):
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "conv.jsonl"
    info = write_records(path, n=1500, fmt="sharegpt", empty_rate=0.02, huge_every=300, malformed_rate=0.002, seed=3)
    assert info["malformed"] > 0
    return path, info


def test_prepare_cli(model, data, tmp_path, tok):
    path, info = data
    out = tmp_path / "sub" / "train.parquet"
    s = last_json(run("unsloth-prep", "prepare", path, "--tokenizer", model, "--out", out, "--max-seq-length", 512,
                      "--on-error", "skip"))
    for k in ("rows", "dropped", "truncated", "tokens", "trainable_tokens", "seconds", "peak_rss_mb"): assert k in s
    assert s["rejected"] == info["malformed"] and s["records"] + s["rejected"] == info["lines"]
    assert s["rows"] + s["dropped"] == s["records"] and s["dropped_reasons"]["response_too_long"] >= 5
    t = pq.read_table(out)
    assert t.column_names == ["input_ids", "attention_mask", "labels"] and t.num_rows == s["rows"]
    rows = t.to_pylist()
    assert max(len(r["input_ids"]) for r in rows) <= 512
    assert sum(len(r["input_ids"]) for r in rows) == s["tokens"]
    assert sum(sum(x != -100 for x in r["labels"]) for r in rows) == s["trainable_tokens"]
    rep = verify_labels(rows, tok)
    assert rep.ok, rep
    assert not [p for p in out.parent.iterdir() if p.name != "train.parquet"], "temp file left behind"


def test_prepare_cli_errors(model, data, tmp_path):
    path, _ = data
    out = tmp_path / "x.parquet"
    p = run("unsloth-prep", "prepare", path, "--tokenizer", model, "--out", out, check=False)
    assert p.returncode == 2 and str(path) in p.stderr + p.stdout and "line" in p.stderr + p.stdout
    p = run("unsloth-prep", "prepare", path, "--tokenizer", model, "--out", out, "--max-seq-length", 64,
            "--on-overflow", "raise", "--on-error", "skip", check=False)
    assert p.returncode == 2 and "row" in p.stderr + p.stdout and "max_seq_length=64" in p.stderr + p.stdout
    assert not out.exists() and not list(tmp_path.glob(".x.parquet*")), "no half-written output"
    p = run("unsloth-prep", "prepare", path, "--tokenizer", model, "--out", out, "--template", "no-such-template",
            "--on-error", "skip", check=False)
    assert p.returncode == 2 and "no-such-template" in p.stderr + p.stdout


def test_prepare_modes_and_drop(tok, data, tmp_path):
    from unsloth_prep.tokenization import prepare
    path, _ = data
    res = {m: prepare(path, tok, tmp_path / f"{m}.parquet", train_on=m, on_error="skip")
           for m in ("all-assistant", "last-assistant", "all")}
    assert res["all"]["trainable_tokens"] == res["all"]["tokens"] > res["all-assistant"]["trainable_tokens"]
    assert res["all-assistant"]["trainable_tokens"] == res["last-assistant"]["trainable_tokens"]  # single-turn data
    d = prepare(path, tok, tmp_path / "d.parquet", max_seq_length=256, on_overflow="drop", on_error="skip")
    t = prepare(path, tok, tmp_path / "t.parquet", max_seq_length=256, on_error="skip")
    assert d["truncated"] == 0 and d["dropped"] > t["dropped"] and t["truncated"] > 0
    assert d["dropped"] == t["dropped"] + t["truncated"]


def test_stats_cli(model, data, tmp_path, tok):
    path, _ = data
    png = tmp_path / "hist.png"
    s = last_json(run("unsloth-prep", "stats", path, "--tokenizer", model, "--percentile", 95, "--on-error", "skip",
                      "--plot", png))
    for k in ("records", "p50", "p95", "p99", "max", "suggested_max_seq_length", "truncated_share"): assert k in s
    assert s["p50"] <= s["p95"] <= s["p99"] <= s["max"] and s["suggested_max_seq_length"] % 64 == 0
    assert s["suggested_max_seq_length"] >= s["p95"] and 0 < s["truncated_share"] <= 0.05 + 1e-9
    assert png.stat().st_size > 1000
    from unsloth_prep.tokenization import collect_stats
    st, counts, rejected = collect_stats(path, tok, on_error="skip")
    s99 = st.summary(99)
    assert st.summary(95)["suggested_max_seq_length"] == s["suggested_max_seq_length"] and rejected > 0
    assert s99["suggested_max_seq_length"] >= s["suggested_max_seq_length"]
    assert s99["truncated_share"] <= s["truncated_share"]


def test_stats_matches_in_process(tok):
    recs = list(iter_records(400, "openai", seed=9))
    rows = [r for r in (tokenize_conversation(x, tok) for x in recs) if r is not None]
    s = length_stats(rows, percentile=50)
    lens = sorted(len(r["input_ids"]) for r in rows)
    assert s["max"] == lens[-1] and s["records"] == len(rows)
    assert s["suggested_max_seq_length"] == max(64, -(-s["p50"] // 64) * 64)
    assert abs(s["truncated_share"] - sum(n > s["suggested_max_seq_length"] for n in lens) / len(lens)) < 1e-4


def test_tokenize_dataset_streaming_bounded(tok):
    """IterableDataset: lazy (nothing tokenized before iteration), counts filled while streaming."""
    from datasets import IterableDataset
    c = TokenizeCounts()
    ds = IterableDataset.from_generator(lambda: iter_records(2000, "openai", seed=5, huge_every=500))
    out = tokenize_dataset(ds, tok, max_seq_length=1024, counts=c, batch_size=128)
    assert c.rows_in == 0
    n = sum(1 for _ in out)
    assert c.rows_in == 2000 and n == c.rows_out == 2000 - c.dropped and c.reasons["response_too_long"] >= 4


def test_huge_record_memory_bounded(model, tmp_path):
    """A 200k-char answer with max_seq_length: prepare's peak RSS stays near the small-data peak."""
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    write_records(small, n=200, fmt="openai", seed=1)
    write_records(big, n=200, fmt="openai", seed=1, huge_every=2)  # 100 records of 200k chars
    peaks = {}
    for name, p in (("small", small), ("big", big)):
        s = last_json(run("unsloth-prep", "prepare", p, "--tokenizer", model, "--out", tmp_path / f"{name}.parquet",
                          "--max-seq-length", 1024, "--batch-size", 100))
        peaks[name] = s["peak_rss_mb"]
    assert s["dropped_reasons"]["response_too_long"] >= 100
    assert peaks["big"] < peaks["small"] + 300, peaks
