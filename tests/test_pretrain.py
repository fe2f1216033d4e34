"Continued pretraining in fresh processes: the prepare entry point on a dirty corpus, and a few training steps."
import json, sys, textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from clitools import last_json, read_rows, run
from unsloth_prep.outputs import REJECTS, build_dir

_MAIN = """
import sys
from unsloth_prep.cli import main
sys.exit(main(["prepare", "--task", "pretrain"] + sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from unsloth_prep.fixtures import tiny_model, write_corpus
    d = tmp_path_factory.mktemp("pretrain")
    info = write_corpus(d / "c.jsonl", 120, seed=7, empty_rate=0.05, huge_every=60, malformed_rate=0.03)
    return {"dir": d, "info": info, "model": str(tiny_model())}


def test_prepare_main_fresh_process(corpus):
    d, info = corpus["dir"], corpus["info"]
    p = run(sys.executable, "-c", _MAIN, d / "c.jsonl", "--tokenizer", corpus["model"], "--out", d / "b",
            "--block-size", "128", "--on-error", "skip", "--stride", "2")
    s = last_json(p)
    assert s["rejected"] == len(info["malformed_lines"]) and s["empty_docs"] == len(info["empty_lines"])
    assert s["documents"] + s["empty_docs"] == info["records"]
    assert s["rejects"] == str(d / "b" / REJECTS)
    assert [json.loads(l)["line"] for l in open(s["rejects"])] == info["malformed_lines"]
    rows = read_rows(d / "b")
    assert len(rows) == s["blocks"] == s["rows"] and set(rows[0]) == {"input_ids", "labels", "position_ids", "seq_lengths"}
    labelled = sum(sum(1 for x in row["labels"] if x != -100) for row in rows)
    assert labelled + s["dropped_tokens"] == s["tokens"] and s["dropped_tokens"] < 128


def test_prepare_main_bad_input_names_file_line_field(corpus):
    d, info = corpus["dir"], corpus["info"]
    p = run(sys.executable, "-c", _MAIN, d / "c.jsonl", "--tokenizer", corpus["model"], "--out", d / "x",
            "--block-size", "128", check=False)
    assert p.returncode != 0 and f"c.jsonl: line {info['malformed_lines'][0]}" in p.stderr
    assert not (d / "x").exists() and not build_dir(d / "x").exists()
    p = run(sys.executable, "-c", _MAIN, d / "c.jsonl", "--tokenizer", corpus["model"], "--out", d / "x",
            "--block-size", "128", "--text-field", "body", check=False)
    assert p.returncode != 0 and "missing field 'body'" in p.stderr and "c.jsonl: line 1" in p.stderr


_TRAIN = """
import unsloth, json, sys, torch
from unsloth_prep.training import train_pretrain
blocks, model, out = sys.argv[1:4]
cfg = {"data": {"path": blocks}, "model": {"name": model, "cpu_threads": 2}, "max_seq_length": 128,
       "lora": {"r": 8, "alpha": 16}, "output_dir": out, "generate": None,
       "trainer": {"max_steps": 3, "learning_rate": 5e-3, "embedding_learning_rate": 5e-4, "warmup_steps": 0}}
s = train_pretrain(cfg, return_trainer=True)
tr = s.pop("_trainer")
mods = {n.rsplit(".", 1)[-1]: m for n, m in tr.model.named_modules() if n.endswith(("embed_tokens", "lm_head"))
        and hasattr(m, "original_module")}
changed = {k: int(((m.modules_to_save["default"].weight - m.original_module.weight).abs().sum(-1) > 0).sum())
           for k, m in mods.items()}
ids = {k: id(m.modules_to_save["default"].weight) for k, m in mods.items()}
groups = [(g["initial_lr"], sorted(k for k, i in ids.items() if any(id(p) == i for p in g["params"])))
          for g in tr.optimizer.param_groups]
from itertools import islice
restarts = sum(int((b["position_ids"][:, 1:] == 0).sum()) for b in islice(tr.get_train_dataloader(), 20))
print(json.dumps({**s, "changed": changed, "groups": groups, "restarts": restarts}))
"""


def test_train_pretrain_embeddings_train_at_their_own_rate(corpus):
    from unsloth_prep.pretrain import prepare_pretrain
    d = corpus["dir"]
    prepare_pretrain(d / "c.jsonl", corpus["model"], d / "t.parquet", 128, on_error="skip")
    s = last_json(run(sys.executable, "-c", _TRAIN, d / "t.parquet", corpus["model"], d / "run", timeout=600))
    assert s["steps"] == 3 and s["first_loss"] and s["final_loss"]
    assert "embed_tokens" in s["lora_targets"] and "lm_head" in s["lora_targets"]
    assert s["changed"]["embed_tokens"] > 0 and s["changed"]["lm_head"] > 0     # the embedding rows moved
    emb = [lr for lr, names in s["groups"] if names]
    other = [lr for lr, names in s["groups"] if not names]
    assert emb and all(lr == 5e-4 for lr in emb) and other and all(lr == 5e-3 for lr in other)
    assert s["restarts"] > 0                                                      # position ids restart per document
    assert (Path(s["adapter"]) / "adapter_config.json").exists()


def test_finish_runs_without_the_tokenizer_and_matches_one_pass(corpus, tmp_path):
    "In one process the blocks are cut after the tokenizer is released, into the rows `prepare_pretrain` writes."
    from unsloth_prep import parallel
    from unsloth_prep.api import prepare
    from unsloth_prep.pretrain import prepare_pretrain
    seen = []
    finish = parallel._finish
    def spy(*a, **kw):
        seen.append(dict(parallel._STATE))
        return finish(*a, **kw)
    parallel._finish = spy
    try: ds = prepare(corpus["dir"] / "c.jsonl", corpus["model"], tmp_path / "out", task="pretrain", block_size=64,
                      stride=3, keep_last=True, on_error="skip")
    finally: parallel._finish = finish
    assert seen == [{}]
    one = prepare_pretrain(corpus["dir"] / "c.jsonl", corpus["model"], tmp_path / "one.parquet", 64, stride=3,
                           keep_last=True, on_error="skip")
    assert ds.num_rows == one["rows"] > 0
    assert ds.to_dict() == pq.read_table(tmp_path / "one.parquet").to_pydict()
