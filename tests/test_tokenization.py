"""`unsloth-prep stats` / `prepare` in fresh processes, bounded memory on big inputs, and tokenize_dataset on streams."""
import json, shutil, subprocess, sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from unsloth_prep.fixtures import iter_records, tiny_model, write_records
from unsloth_prep.tokenization import (TokenizeCounts, length_stats, tokenize_conversation, tokenize_dataset, verify_labels)
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep.base import MANIFEST
from unsloth_prep.outputs import README, REJECTS, data_files
from clitools import last_json, run


def runs(labels):
    """[start, end) runs of trained positions, computed here (not with the package's helper)."""
    out, start = [], None
    for i, x in enumerate(list(labels) + [-100]):
        if x != -100 and start is None: start = i
        if x == -100 and start is not None: out.append((start, i)); start = None
    return out


def source_conversations(path):
    """The source file's conversations, read independently of the package (sharegpt or openai JSONL, bad lines skipped)."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try: rec = json.loads(line)
        except ValueError: continue
        if "conversations" in rec:
            rec = {"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in rec["conversations"]]}
        out.append(rec)
    return out


def check_trained_text(rows, convs, tok, train_on="all-assistant", end="<|im_end|>"):
    """Each row's trained tokens decode to exactly the answers of a source conversation, each + the end-of-turn token.

    Rows and conversations are walked in order (a dropped conversation is skipped); prompt tokens trained, an answer
    cut short or a missing end-of-turn token make a row match no conversation. Returns the rows matched."""
    j = 0
    for r in rows:
        got = [tok.decode(r["input_ids"][a:b]) for a, b in runs(r["labels"])]
        while True:
            assert j < len(convs), f"trained text {got[:2]!r} matches no source conversation"
            want = [m["content"] + end for m in convs[j]["messages"]
                    if m["role"] == "assistant" and m["content"].strip() and m.get("loss_weight", 1) != 0]
            j += 1
            if train_on == "last-assistant": want = want[-1:]
            if got and got == want[-len(got):]: break
    return len(rows)


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
    out = tmp_path / "sub" / "train"
    s = last_json(run("unsloth-prep", "prepare", path, "--tokenizer", model, "--out", out, "--max-seq-length", 512,
                      "--on-error", "skip"))
    # `records` counts every record read, the rejected (malformed) lines included
    assert s["rejected"] == info["malformed"] and s["records"] == info["lines"] - info["blank"]
    assert s["rows"] + s["dropped"] + s["rejected"] == s["records"] and s["dropped_reasons"]["response_too_long"] >= 5
    t = pq.read_table(data_files(out))
    assert t.column_names == ["input_ids", "attention_mask", "labels"] and t.num_rows == s["rows"]
    rows = t.to_pylist()
    assert max(len(r["input_ids"]) for r in rows) <= 512
    assert sum(len(r["input_ids"]) for r in rows) == s["tokens"]
    assert sum(sum(x != -100 for x in r["labels"]) for r in rows) == s["trainable_tokens"]
    rep = verify_labels(rows, tok)
    assert rep.ok, rep
    assert check_trained_text(rows, source_conversations(path), tok) == s["rows"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["train"], "temp file left"
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, README, REJECTS, *(Path(f).name for f in s["files"])])
    assert s["rejects"] == str(out / REJECTS)
    assert len((out / REJECTS).read_text().splitlines()) == s["rejected"] == Path(s["rejects"]).read_text().count("\n")


def test_prepare_cli_errors(model, data, tmp_path):
    path, _ = data
    out = tmp_path / "x"
    p = run("unsloth-prep", "prepare", path, "--tokenizer", model, "--out", out, check=False)
    assert p.returncode == 2 and str(path) in p.stderr + p.stdout and "line" in p.stderr + p.stdout
    p = run("unsloth-prep", "prepare", path, "--tokenizer", model, "--out", out, "--max-seq-length", 64,
            "--on-overflow", "raise", "--on-error", "skip", check=False)
    assert p.returncode == 2 and "row" in p.stderr + p.stdout and "max_seq_length=64" in p.stderr + p.stdout
    assert not out.exists() and not list(tmp_path.glob(".x*")), "no half-written output"
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
    convs = source_conversations(path)
    for m in ("all-assistant", "last-assistant"):
        rows = pq.read_table(tmp_path / f"{m}.parquet").to_pylist()
        assert check_trained_text(rows, convs, tok, m) == res[m]["rows"]
    rows = pq.read_table(tmp_path / "all.parquet").to_pylist()
    assert all(r["labels"] == r["input_ids"] for r in rows)
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert check_trained_text(rows, convs, tok) == t["rows"] and max(len(r["input_ids"]) for r in rows) <= 256


def test_stats_cli(model, data, tmp_path, tok):
    path, _ = data
    png = tmp_path / "hist.png"
    s = last_json(run("unsloth-prep", "stats", path, "--tokenizer", model, "--percentile", 95, "--on-error", "skip",
                      "--plot", png))
    assert s["p50"] <= s["p95"] <= s["p99"] <= s["max"] and s["suggested_max_seq_length"] % 64 == 0
    assert s["suggested_max_seq_length"] >= s["p95"] and 0 < s["truncated_share"] <= 0.05 + 1e-9
    assert png.stat().st_size > 1000
    from unsloth_prep.tokenization import collect_stats
    st, counts, rejected = collect_stats(path, tok, on_error="skip")
    s99 = st.summary(99)
    assert st.summary(95)["suggested_max_seq_length"] == s["suggested_max_seq_length"] and rejected > 0
    assert s99["suggested_max_seq_length"] >= s["suggested_max_seq_length"]
    assert s99["truncated_share"] <= s["truncated_share"]


def test_stats_percentiles_with_numpy(model, data, tmp_path, tok):
    """The CLI's percentiles are numpy's method='higher' over the row lengths, the suggestion that rounded UP to 64."""
    from unsloth_prep.tokenization import prepare
    path, _ = data
    s = last_json(run("unsloth-prep", "stats", path, "--tokenizer", model, "--on-error", "skip", "--percentile", 90))
    prepare(path, tok, tmp_path / "all.parquet", on_error="skip")
    rows = pq.read_table(tmp_path / "all.parquet").to_pylist()
    lens = np.array([len(r["input_ids"]) for r in rows])
    for q in (50, 95, 99): assert s[f"p{q}"] == int(np.percentile(lens, q, method="higher")), q
    p90 = int(np.percentile(lens, 90, method="higher"))
    assert s["suggested_max_seq_length"] == max(64, -(-p90 // 64) * 64)
    assert s["truncated_share"] == round(float((lens > s["suggested_max_seq_length"]).mean()), 5)


def test_length_stats_rounding_and_method():
    """Crafted lengths where method='lower' or 'nearest' and rounding to the nearest multiple give other answers."""
    lens = [100 + 7 * i for i in range(30)] + [1030, 1040]
    rows = [{"input_ids": [1] * n, "labels": [-100] * (n - 5) + [1] * 5} for n in lens]
    s = length_stats(rows, percentile=95)
    hi, lo = (int(np.percentile(lens, 95, method=m)) for m in ("higher", "lower"))
    assert hi != lo and hi != int(np.percentile(lens, 95, method="nearest")) and hi % 64 < 32  # the data can tell the methods and roundings apart
    assert s["p95"] == hi and s["suggested_max_seq_length"] == -(-hi // 64) * 64
    assert s["suggested_max_seq_length"] != round(hi / 64) * 64


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
        s = last_json(run("unsloth-prep", "prepare", p, "--tokenizer", model, "--out", tmp_path / name,
                          "--max-seq-length", 1024, "--batch-size", 100))
        peaks[name] = s["peak_rss_mb"]
    assert s["dropped_reasons"]["response_too_long"] >= 100
    assert peaks["big"] < peaks["small"] + 300, peaks


def test_tokenizer_errors_cli(data, tmp_path, model):
    """A missing folder, a Hub name offline, a folder without chat template: exit 2, one line, no traceback."""
    import os
    path, _ = data
    out = tmp_path / "x"
    p = run("unsloth-prep", "prepare", path, "--tokenizer", "/no/such/dir", "--out", out, check=False)
    assert p.returncode == 2 and "/no/such/dir: no such tokenizer folder" in p.stderr and "Traceback" not in p.stderr
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(["unsloth-prep", "stats", str(path), "--tokenizer", "someone/some-model"], capture_output=True,
                       text=True, env=env)
    assert p.returncode == 2 and "offline" in p.stderr and "someone/some-model" in p.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(model) / "tokenizer.json", bare / "tokenizer.json")
    cfg = json.loads((Path(model) / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "chat_template"}))
    p = run("unsloth-prep", "prepare", path, "--tokenizer", bare, "--out", out, check=False)
    assert p.returncode == 2 and "no chat template" in p.stderr and "--template llama-3.1" in p.stderr
    assert "Traceback" not in p.stderr and not out.exists() and not list(tmp_path.glob(".x*"))


def test_loss_weight_masks_answers(tok, tmp_path):
    """loss_weight 0 on an assistant message masks it; 1 (or absent) trains it; all-zero rows are dropped and counted."""
    from unsloth_prep.tokenization import prepare
    recs = []
    for k, r in enumerate(iter_records(60, "openai", seed=4)):
        m = [x for x in r["messages"] if x["role"] != "system"]
        extra = [{"role": "user", "content": f"and {k}?"}, {"role": "assistant", "content": f"answer {k}"}]
        m = [dict(x, loss_weight=0) if x["role"] == "assistant" and k % 3 else x for x in m] + extra
        recs.append({"messages": m if k % 5 else [dict(x, loss_weight=0) if x["role"] == "assistant" else x for x in m]})
    s = prepare(recs, tok, tmp_path / "lw.parquet")
    rows = pq.read_table(tmp_path / "lw.parquet").to_pylist()
    kept = [r for k, r in enumerate(recs) if k % 5]
    assert s["dropped_reasons"].get("loss_weight_0") == len(recs) - len(kept) and s["rows"] == len(rows)
    assert check_trained_text(rows, [r for r in kept if any(x["content"].strip() for x in r["messages"])], tok) == len(rows)
    masked = sum(tok.decode(r["input_ids"]).count("<|im_end|>") for r in rows)
    trained = sum(len(runs(r["labels"])) for r in rows)
    assert trained < masked - len(rows)      # the weight-0 answers are in the rows, not in the labels
