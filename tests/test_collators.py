"""unsloth_prep.collators beyond the notebook: CLI in a fresh process, packing invariants on random data, atomic output,
bounded memory of the streaming paths, per-example loss equality on the tiny model, and a Trainer step with each collator."""
import json, subprocess, sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unsloth_prep.base import TOKEN_PARQUET, sink_options  # what ParquetSink writes
from unsloth_prep.collators import (IGNORE_INDEX, PackedCollator, PaddingCollator, chunk_blocks, pack_dataset, pack_lengths,
                                    pack_parquet, pack_stream, pack_table, waste_report)


def synthetic_rows(n, seed=0, max_len=600, vocab=4000):
    """Tokenized rows with long-tailed lengths and a masked prompt of random length."""
    rng = np.random.default_rng(seed)
    out = []
    for L in np.clip(rng.lognormal(4.5, 0.9, n).astype(int), 2, max_len):
        ids = rng.integers(5, vocab, L).tolist()
        p = int(rng.integers(1, L))
        out.append({"input_ids": ids, "attention_mask": [1] * L, "labels": [IGNORE_INDEX] * p + ids[p:]})
    return out


def split_row(row):
    """The examples of a packed row as (input_ids, labels) tuples."""
    out, s = [], 0
    for n in row["seq_lengths"]:
        out.append((tuple(row["input_ids"][s:s + n]), tuple(row["labels"][s:s + n]))); s += n
    return out


@pytest.mark.parametrize("seed", range(5))
def test_pack_table_invariants_random(seed):
    rng = np.random.default_rng(seed)
    rows = synthetic_rows(int(rng.integers(50, 400)), seed=seed)
    cap = int(rng.integers(64, 700))
    packed, st = pack_table(pa.Table.from_pylist(rows), cap)
    got = []
    for r in packed.to_pylist():
        assert 0 < len(r["input_ids"]) <= cap
        assert len(r["labels"]) == len(r["position_ids"]) == len(r["input_ids"]) == sum(r["seq_lengths"])
        s = 0
        for n in r["seq_lengths"]:
            assert r["position_ids"][s:s + n] == list(range(n)); s += n
        got += split_row(r)
    want = [(tuple(r["input_ids"]), (IGNORE_INDEX,) + tuple(r["labels"][1:])) for r in rows if len(r["input_ids"]) <= cap]
    assert sorted(got) == sorted(want)                       # every example once, labels unchanged but the boundary
    assert st["rejected"] == sum(len(r["input_ids"]) > cap for r in rows)
    assert st["rows"] == pack_lengths([len(r["input_ids"]) for r in rows], cap).n_rows


def test_pack_split_keeps_every_token_in_order():
    rows = synthetic_rows(100, seed=3, max_len=900)
    packed, st = pack_table(pa.Table.from_pylist(rows), 128, overflow="split")
    pieces = [p for r in packed.to_pylist() for p in split_row(r)]
    assert st["rejected"] == 0 and st["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert all(len(p[0]) <= 128 for p in pieces)
    # the fragments of every long row, in order, rebuild it
    fragments = {p[0] for p in pieces}
    for r in rows:
        ids = tuple(r["input_ids"])
        assert all(ids[i:i + 128] in fragments for i in range(0, len(ids), 128))


def test_pack_parquet_is_atomic(tmp_path, monkeypatch):
    rows = synthetic_rows(200)
    src, dst = tmp_path / "tok.parquet", tmp_path / "packed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    import unsloth_prep.collators as c

    def boom(sink, *a, **kw):  # the disk fills up half way through the output
        Path(sink.tmp).write_bytes(b"PAR1 half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(c, "_write_groups", boom)
    with pytest.raises(ValueError, match="packed.parquet: cannot write: No space left on device"):
        pack_parquet(src, dst, 256)
    assert list(tmp_path.iterdir()) == [src]                 # no output, no temp file and no run files after a crash
    monkeypatch.undo()
    st = pack_parquet(src, dst, 256)
    assert pq.read_table(dst).num_rows == st["rows"] and st["efficiency"] > 0.95


def test_cli_pack_fresh_process(tmp_path):
    from unsloth_prep.cli import COMMANDS
    if "pack" not in COMMANDS:
        pytest.skip("`pack` is not registered in unsloth_prep.cli.COMMANDS yet (requested from the lead)")
    rows = synthetic_rows(300, max_len=400) + [{"input_ids": [7] * 2000, "attention_mask": [1] * 2000, "labels": [7] * 2000}]
    src, dst = tmp_path / "tok.parquet", tmp_path / "out" / "packed"
    pq.write_table(pa.Table.from_pylist(rows), src)
    proc = subprocess.run(["unsloth-prep", "pack", str(src), str(dst), "--max-seq-length", "512"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    from unsloth_prep.outputs import data_files
    assert summary["rows"] == pq.read_table(data_files(dst)).num_rows and summary["rejected"] == 1
    assert summary["rejects"] == str(dst / "rejects.parquet")
    assert pq.read_table(summary["rejects"])["row"].to_pylist() == [300]
    bad = subprocess.run(["unsloth-prep", "pack", str(tmp_path / "nope.parquet"), str(dst), "--max-seq-length", "512"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "nope.parquet" in (bad.stdout + bad.stderr)


def _gen_rows(n_rows, seed=0):
    """A lazily generated stream of tokenized rows."""
    rng = np.random.default_rng(seed)
    for L in np.clip(rng.lognormal(5.0, 0.8, n_rows).astype(int), 2, 1024):
        ids = list(range(L))
        yield {"input_ids": ids, "labels": ids}


def stream_pack_count(n_rows, buffer_size):
    """Pack a generated stream (run in a fresh process by the memory test); returns the rows emitted."""
    return sum(1 for _ in pack_stream(_gen_rows(n_rows), 1024, buffer_size=buffer_size))


def whole_pack_count(n_rows):
    """The same rows materialised and packed as a table: the unbounded reference."""
    return pack_table(pa.Table.from_pylist(list(_gen_rows(n_rows))), 1024)[1]["rows"]


def test_pack_stream_memory_is_bounded():
    from unsloth_prep.memory import isolated
    small = isolated(stream_pack_count, 5_000, 500, keep_result=True)
    large = isolated(stream_pack_count, 40_000, 500, keep_result=True)
    whole = isolated(whole_pack_count, 20_000)            # materialising only half as many rows
    assert large.value > 7 * small.value
    # 8x the rows, about the same peak (bounded by the buffer), far below materialising the stream
    assert large.peak_mb < small.peak_mb + 40, (small.peak_mb, large.peak_mb)
    assert large.peak_mb - small.peak_mb < (whole.peak_mb - small.peak_mb) / 4, (small.peak_mb, large.peak_mb, whole.peak_mb)


def test_chunk_blocks_huge_documents_bounded():
    from unsloth_prep.memory import track
    st = {}
    docs = (list(range(500_000)) for _ in range(20))          # 10M tokens, one 500k-token document at a time
    with track("chunk") as r:
        n = sum(1 for _ in chunk_blocks(docs, 2048, eos_token_id=0, overlap=1, stats=st))
    assert st["tokens"] == 20 * 500_001 and st["labelled_tokens"] == st["tokens"] and n == st["blocks"]
    assert r.delta_mb < 150, r.delta_mb                      # the 20 documents as Python lists: ~380 MB


def test_padding_collator_edge_cases():
    c = PaddingCollator(pad_token_id=9, pad_to_multiple_of=None, padding_side="left", return_tensors="np")
    b = c([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4], "labels": [4]}])
    assert b["input_ids"].tolist() == [[1, 2, 3], [9, 9, 4]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b["labels"].tolist() == [[-100, 2, 3], [-100, -100, 4]]
    with pytest.raises(ValueError, match="empty batch"):
        c([])
    with pytest.raises(ValueError, match="row 1: field 'labels' is missing"):
        c([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])


def test_waste_report_matches_brute_force():
    rng = np.random.default_rng(1)
    L = rng.integers(1, 300, 101)
    rep = waste_report(L, 256, batch_size=4, pad_to_multiple_of=8)
    kept = np.minimum(L, 256)
    assert rep["fixed"]["slots"] == 101 * 256 and rep["fixed"]["lost_tokens"] == int((L - kept).sum())
    assert all(r["real"] == kept.sum() for r in rep.values())
    assert rep["packed"]["rows"] == pack_lengths(kept, 256).n_rows
    assert all(r["batches"] == -(-r["rows"] // 4) for r in rep.values())


# ---------------------------------------------------------------- tiny model: loss equality and a Trainer step

@pytest.fixture(scope="module")
def tiny():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from unsloth_prep.fixtures import tiny_model
    torch.manual_seed(0)
    path = tiny_model()
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def per_example_losses(logits, labels, seq_lengths):
    """Mean next-token loss of each example inside a packed row (labels already -100 at boundaries)."""
    import torch
    out, s = [], 0
    for n in seq_lengths:
        lg, lb = logits[s:s + n - 1], labels[s + 1:s + n]
        out.append(torch.nn.functional.cross_entropy(lg.float(), lb, ignore_index=IGNORE_INDEX).item()); s += n
    return out


@pytest.mark.parametrize("mode", ["padding_free", "position_ids", "mask4d"])
def test_packed_loss_equals_alone(tiny, mode):
    import torch
    _, tok, model = tiny
    rows = synthetic_rows(12, seed=5, max_len=200, vocab=3000)
    packed = pack_table(pa.Table.from_pylist(rows), 512)[0].to_pylist()
    batch = PackedCollator(pad_token_id=tok.pad_token_id, mode=mode)(packed)
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
        alone = {}
        for r in rows:
            lg = model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0]
            alone[tuple(r["input_ids"])] = per_example_losses(lg, torch.tensor(r["labels"]), [len(r["input_ids"])])[0]
    checked = 0
    if mode == "padding_free":
        flat = [(logits[0], batch["labels"][0], [n for p in packed for n in p["seq_lengths"]], [x for p in packed for x in p["input_ids"]])]
    else:
        flat = [(logits[i], batch["labels"][i], p["seq_lengths"], p["input_ids"]) for i, p in enumerate(packed)]
    for lg, lb, seqs, ids in flat:
        s = 0
        for n, loss in zip(seqs, per_example_losses(lg, lb, seqs)):
            ref = alone[tuple(ids[s:s + n])]
            if not np.isnan(ref): assert abs(loss - ref) < 1e-4, (loss, ref); checked += 1
            s += n
    assert checked >= 10
    # the contaminated input: same tokens with an all-ones mask, default positions
    with torch.no_grad():
        ids = torch.tensor([packed[0]["input_ids"]])
        bad = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
    losses = per_example_losses(bad, torch.tensor(packed[0]["labels"]), packed[0]["seq_lengths"])
    s, diffs = packed[0]["seq_lengths"][0], []
    for n, loss in zip(packed[0]["seq_lengths"][1:], losses[1:]):
        diffs.append(abs(loss - alone[tuple(packed[0]["input_ids"][s:s + n])])); s += n
    assert max(diffs) > 1e-3


@pytest.mark.parametrize("collator", ["padding", "packed"])
def test_trainer_step_with_collator(tiny, tmp_path, collator):
    import datasets
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    path, tok, _ = tiny
    rows = synthetic_rows(32, seed=2, max_len=120, vocab=3000)
    if collator == "padding":
        ds, coll = datasets.Dataset.from_list(rows), PaddingCollator.from_tokenizer(tok)
    else:
        ds, coll = pack_dataset(datasets.Dataset.from_list(rows), 256), PackedCollator.from_tokenizer(tok)
    model = AutoModelForCausalLM.from_pretrained(path)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, remove_unused_columns=False, logging_steps=1, save_strategy="no")
    out = Trainer(model=model, args=args, train_dataset=ds, data_collator=coll).train()
    assert np.isfinite(out.training_loss) and out.global_step == 2


@pytest.mark.parametrize("overflow", ["drop", "split"])
def test_pack_parquet_bounded_same_bytes_as_memory(tmp_path, overflow):
    """The bounded path (lengths, runs per row group) writes the bytes of pack_table over the whole table."""
    rows = synthetic_rows(700, seed=11, max_len=900)
    rows[5]["input_ids"], rows[5]["labels"] = [], []                # an empty row
    rows[5]["attention_mask"] = []
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "tok.parquet", row_group_size=97)
    st = pack_parquet(tmp_path / "tok.parquet", tmp_path / "bounded.parquet", 300, overflow=overflow, row_group_rows=16)
    packed, ref = pack_table(table, 300, overflow=overflow)
    settings = json.dumps({"packed": True, "max_seq_length": 300}).encode()   # what pack records (no prepare settings)
    pq.write_table(packed.replace_schema_metadata({b"unsloth_prep": settings}), tmp_path / "memory.parquet",
                   row_group_size=16, **sink_options(packed.schema, TOKEN_PARQUET))
    assert (tmp_path / "bounded.parquet").read_bytes() == (tmp_path / "memory.parquet").read_bytes()
    assert {k: st[k] for k in ref} == ref
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []    # no run files left
    if overflow == "drop":
        rej = pq.read_table(st["rejects"])
        assert rej["row"].to_pylist() == [i for i, r in enumerate(rows) if len(r["input_ids"]) > 300]
        assert rej["input_ids"].to_pylist() == [r["input_ids"] for r in rows if len(r["input_ids"]) > 300]


def test_pack_stream_positions_restart_per_example():
    """Each example of a streamed packed row starts at position 0 and its first label is masked."""
    rows = synthetic_rows(300, seed=5, max_len=500)
    for r in pack_stream(iter(rows), 1024, buffer_size=64):
        s = 0
        for n in r["seq_lengths"]:
            assert r["position_ids"][s:s + n] == list(range(n)) and r["labels"][s] == IGNORE_INDEX
            s += n
