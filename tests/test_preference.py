"""Preference preparation: every row of every task verified for every template, overflow, CLI in a fresh process.

The pair verifier (`verify_pairs`) re-renders each example and decodes each prepared row back: prompt = the rendered
prompt with the generation prompt (or its end after a cut), each answer = exactly the text after that prompt through
the end-of-turn token, the same prompt in both halves, nothing longer than max_length. It runs on every row here, with
multi-turn and system prompts, Chinese and English, answers that start or end with whitespace, empty answers, and
prompts long enough to be cut.
"""
import json, subprocess, sys

import pyarrow.parquet as pq
import pytest

from clitools import read_rows
from unsloth_prep.fixtures import iter_records, tiny_model
from unsloth_prep.preference import PairTokenizer, prepare_preference, read_examples, verify_pairs
from unsloth_prep.tokenizer import UNSLOTH_TEMPLATES, load_tokenizer, resolve_templates

TEMPLATES = (None,) + UNSLOTH_TEMPLATES


def pair_records(n=40):
    """Deterministic pairs in TRL's conversational, plain and implicit-prompt forms (a mix of shapes and languages)."""
    recs = list(iter_records(3 * n, "openai", seed=5))
    out = []
    for k in range(n):
        m = recs[k]["messages"]
        prompt = [x for x in m if x["role"] != "assistant"]
        chosen, rejected = m[-1]["content"][:300], recs[n + k]["messages"][-1]["content"][:300]
        if k % 5 == 1:
            extra = [{"role": "assistant", "content": "先说一句。"}, {"role": "user", "content": "继续 please"}]
            prompt = prompt + extra
        if k % 5 == 2: chosen, rejected = "\n  " + chosen + " \n", "  " + rejected
        if k % 5 == 3 and prompt[0]["role"] != "system": prompt = [{"role": "system", "content": "Be kind."}] + prompt
        if k % 7 == 4: prompt = [dict(prompt[-1], content=prompt[-1]["content"] * 30)]  # long: cut at max_length
        if k % 11 == 6: rejected = ""
        if k % 3 == 0:
            out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        elif k % 3 == 1:
            out.append({"chosen": prompt + [{"role": "assistant", "content": chosen}],
                        "rejected": prompt + [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": prompt[-1]["content"], "chosen": chosen, "rejected": rejected})
    return out


def kto_records(pairs):
    """KTO records in TRL's form and LLaMA-Factory's `kto_tag` form."""
    out = []
    for k, r in enumerate(read_examples(pairs)[1]):
        ex = r[1]
        if k % 2: out.append({"prompt": ex["prompt"], "completion": ex["rejected"], "label": False})
        else: out.append({"messages": ex["prompt"] + ex["chosen"], "kto_tag": True})
    return out


@pytest.fixture(scope="module")
def tokenizers():
    path = tiny_model()
    resolve_templates([(path, t) for t in UNSLOTH_TEMPLATES])
    return {t: load_tokenizer(path, t) for t in TEMPLATES}


def check_all_rows(tok, data, task, out, max_length=None):
    s = prepare_preference(data, tok, out, task=task, max_length=max_length)
    rows = pq.read_table(out).to_pylist()
    assert s["dropped"] == 0 and len(rows) == s["rows"] == len(data), s
    rep = verify_pairs(rows, read_examples(data, task)[1], PairTokenizer(tok, max_length))
    assert rep["ok"] and rep["rows"] == len(rows), rep
    return s, rows


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_row_every_template(tokenizers, tmp_path, template):
    tok, pairs = tokenizers[template], pair_records()
    for task in ("dpo", "orpo"):
        s, rows = check_all_rows(tok, pairs, task, tmp_path / f"{task}.parquet")
        assert s["dropped"] == 0 and s["truncated"] == 0
    check_all_rows(tok, kto_records(pairs), "kto", tmp_path / "kto.parquet")
    full = pq.read_table(tmp_path / "dpo.parquet").to_pylist()
    limit = max(max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in full) + 8  # every answer fits
    assert limit < max(len(r["prompt_ids"]) for r in full)  # the long prompts must be cut, the rows still verify
    s, rows = check_all_rows(tok, pairs, "dpo", tmp_path / "cut.parquet", max_length=limit)
    assert s["truncated"] > 0, s
    assert all(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) <= limit for r in rows)


CLI = """
import sys
from unsloth_prep import cli
sys.exit(cli.main(["prepare", "--task", "auto"] + sys.argv[1:]))
"""


def run_cli(*args):
    return subprocess.run([sys.executable, "-c", CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def _registry(reg):
    "A LLaMA-Factory registry folder with a ranking entry and a KTO entry (whose second label is not a boolean)."
    reg.mkdir()
    (reg / "rank.json").write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"}],
         "chosen": {"from": "gpt", "value": "Hello!"}, "rejected": {"from": "gpt", "value": "Go."}}]))
    (reg / "kto.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}], "tag": True},
        {"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Go"}], "tag": "false"}]))
    (reg / "dataset_info.json").write_text(json.dumps({
        "rank": {"file_name": "rank.json", "formatting": "sharegpt", "ranking": True,
                 "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
        "kto": {"file_name": "kto.jsonl", "formatting": "sharegpt",
                "columns": {"messages": "messages", "kto_tag": "tag"}}}))


def _rank_run(tmp_path, *task):
    "The ranking entry through the command (`--task auto` unless a task is given), verified."
    p = run_cli("rank", "--dataset-info", tmp_path / "data", "--tokenizer", tiny_model(), "--out", tmp_path / "r",
                "--verify", *task)
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert (s["task"], s["rows"], s["verified_rows"]) == ("dpo", 1, 1), s


def _kto_runs(tmp_path, *task):
    "The KTO entry through the command: its bad label stops the run by line, or is skipped and counted."
    reg, tok = tmp_path / "data", tiny_model()
    p = run_cli("kto", "--dataset-info", reg, "--tokenizer", tok, "--out", tmp_path / "k", *task)
    assert p.returncode == 2 and "kto.jsonl: line 2: field 'tag' must be a boolean" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "k").exists()
    p = run_cli("kto", "--dataset-info", reg, "--tokenizer", tok, "--out", tmp_path / "k", "--on-error", "skip", *task)
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert (s["task"], s["rows"], s["rejected"]) == ("kto", 1, 1), s
    assert [r["label"] for r in read_rows(tmp_path / "k")] == [True]


def test_cli_fresh_process(tmp_path):
    """The command in a fresh process: LLaMA-Factory ranking + KTO registry entries, --verify, and a bad label."""
    _registry(tmp_path / "data")   # outputs go beside the registry's folder (an input: nothing is written inside)
    _rank_run(tmp_path)
    _kto_runs(tmp_path)


def test_cli_ranking_entry_named_task(tmp_path):
    _registry(tmp_path / "data")
    _rank_run(tmp_path, "--task", "dpo")


def test_cli_kto_entry_named_task(tmp_path):
    _registry(tmp_path / "data")
    _kto_runs(tmp_path, "--task", "kto")


TRAIN = r"""
import json, sys
from pathlib import Path
from unsloth_prep.fixtures import tiny_model
from unsloth_prep.preference import prepare_preference
from unsloth_prep.training import train_preference
from unsloth_prep.tokenizer import load_tokenizer
tmp = Path(sys.argv[1])
recs = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}: 你好?"}],
         "chosen": f"Hi number {i}!", "rejected": "No."} for i in range(6)]
out = {}
for task in ("dpo", "kto", "orpo"):
    data = tmp / f"{task}.parquet"
    prepare_preference(recs, load_tokenizer(tiny_model()), data, task=task)
    cfg = {"model": {"name": str(tiny_model())}, "data": {"path": str(data)}, "max_seq_length": 128,
           "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, "output_dir": str(tmp / task),
           "trainer": {"max_steps": 2, "per_device_train_batch_size": 2}}
    out[task] = train_preference(cfg, task)
print(json.dumps(out))
"""


def test_train_each_task_fresh_process(tmp_path):
    """Two steps of DPO, KTO (from the same pairs, unpaired) and ORPO on the tiny model: the batches the trainer's
    collator builds hold exactly the prepared ids (a re-tokenized or shifted row fails), and the adapter is saved."""
    p = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    reports = json.loads(p.stdout.strip().splitlines()[-1])
    for task, r in reports.items():
        assert r["steps"] == 2 and len(r["losses"]) == 2, (task, r)
        assert r["batches"]["exact"] and r["batches"]["sequences"] >= 4, (task, r)
        assert (tmp_path / task / "adapter" / "adapter_config.json").exists()


U = lambda t: {"role": "user", "content": t}  # noqa: E731
A = lambda t: {"role": "assistant", "content": t}  # noqa: E731
Q = "Explain why the sky looks blue at noon, please."
DEFECTS = {  # code: (record that has it, the same record fixed)
    "chosen_equals_rejected": ({"prompt": Q, "chosen": "Scattering.", "rejected": " Scattering. "},
                               {"prompt": Q, "chosen": "Scattering.", "rejected": "Magic."}),
    "preference_empty_response": ({"prompt": Q, "chosen": "Scattering.", "rejected": "  \n"},
                                  {"prompt": Q, "chosen": "Scattering.", "rejected": "No."}),
    "response_repeats_prompt": ({"prompt": Q, "chosen": Q + " Scattering.", "rejected": "No."},
                                {"prompt": Q, "chosen": "Scattering.", "rejected": "No."}),
    "prompt_mismatch": ({"chosen": [U(Q), A("Scattering.")], "rejected": [U("Other?"), A("No.")]},
                        {"chosen": [U(Q), A("Scattering.")], "rejected": [U(Q), A("No.")]}),
    "pair_truncated": ({"prompt": Q * 20, "chosen": "Scattering.", "rejected": "No."},
                       {"prompt": Q, "chosen": "Scattering.", "rejected": "No."}),
    "pair_dropped": ({"prompt": Q, "chosen": "Scattering. " * 40, "rejected": "No."},
                     {"prompt": Q, "chosen": "Scattering.", "rejected": "No."}),
    "kto_label_type": ({"prompt": Q, "completion": "Scattering.", "label": "false"},
                       {"prompt": Q, "completion": "Scattering.", "label": False}),
    "preference_invalid": ({"prompt": Q, "chosen": [U("not an answer")], "rejected": "No."},
                           {"prompt": Q, "chosen": "Scattering.", "rejected": "No."}),
}


@pytest.mark.parametrize("code", sorted(DEFECTS))
def test_doctor_check_fires_and_not(tmp_path, code):
    """Each preference check names the line of its planted defect and its fix, and is silent on the fixed record."""
    from unsloth_prep.preference import check_preference
    bad, good = DEFECTS[code]
    clean = [{"prompt": [U(f"Question {i}?")], "chosen": f"Answer {i}.", "rejected": "I don't know."} for i in range(5)]
    if code == "kto_label_type": clean = [{"prompt": f"Q{i}?", "completion": "A.", "label": True} for i in range(5)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in clean[:3] + [bad] + clean[3:]))
    tok = load_tokenizer(tiny_model())
    found = check_preference(path, tok, max_length=96)
    assert [f.code for f in found] == [code], [(f.code, f.detail) for f in found]
    assert found[0].examples == [f"{path}: line 4"] and found[0].fix, found[0]
    path.write_text("\n".join(json.dumps(r) for r in clean[:3] + [good] + clean[3:]))
    assert check_preference(path, tok, max_length=96) == []
