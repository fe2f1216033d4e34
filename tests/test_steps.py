"""The step type: adding a task is one module and its registration (workers, eval split, rejects, resume and the
output's layout come with it); the executor and the package branch on no task name; the Python API is the CLI's twin."""
import ast, json
from pathlib import Path

import pytest

from clitools import last_json, read_rows, run
from unsloth_prep.fixtures import tiny_model, write_records

PKG = Path(__file__).resolve().parents[1] / "unsloth_prep"
TASK_WORDS = {"sft", "dpo", "orpo", "kto", "pretrain", "vision", "pairs", "chat", "convert"}


def task_branches(path: Path) -> list:
    "The comparisons (==, !=, in, not in) of a module against a task's name written as a literal."
    def words(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, str): return {n.value}
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in n.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return set()
    return [f"{path.stem}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Compare) and any(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in n.ops)
            and any(words(x) & TASK_WORDS for x in [n.left, *n.comparators])]


def test_the_check_can_fail():
    probe = PKG.parent / "tests" / "_probe_branches.py"
    probe.write_text("def f(task):\n    if task == 'dpo': return 1\n    return task in ('kto', 'orpo')\n")
    try: assert len(task_branches(probe)) == 2
    finally: probe.unlink()


def test_no_task_name_branches_in_the_executor_and_few_elsewhere():
    assert task_branches(PKG / "parallel.py") == [] and task_branches(PKG / "steps.py") == []
    found = [b for f in sorted(PKG.glob("*.py")) if not f.name.startswith("_") for b in task_branches(f)]
    assert len(found) <= 12, found


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    lines = [json.dumps({"text": "Word " * (i % 9 + 1)}) if i % 40 != 39 else json.dumps({"title": "no text"})
             for i in range(400)]
    (d / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return d / "docs.jsonl"


def test_a_task_is_one_module_and_its_registration(docs, tmp_path):
    import toy_task  # noqa: F401  (registers `charcount`)
    from unsloth_prep.pipeline import parse_request, run_prepare
    from unsloth_prep.outputs import data_files
    from unsloth_prep.parallel import rows_digest
    given = {"data": str(docs), "task": "charcount", "tokenizer": "-", "on_error": "skip", "lowercase": True}
    one = run_prepare(*parse_request({**given, "out": str(tmp_path / "one")}, "python"))
    two = run_prepare(*parse_request({**given, "out": str(tmp_path / "two"), "workers": 2, "eval_fraction": 0.25},
                                     "python"))
    assert (one["records"], one["rows"], one["rejected"]) == (400, 390, 10) and one["shards"] == 1
    assert two["splits"]["train"] + two["splits"]["validation"] == 390 and two["rejected"] == 10
    assert [json.loads(l)["line"] for l in open(one["rejects"])] == list(range(40, 401, 40))
    again = run_prepare(*parse_request({**given, "out": str(tmp_path / "one")}, "python"))
    assert again["up_to_date"] and rows_digest(data_files(tmp_path / "one"), ("chars",))
    with pytest.raises(ValueError, match="lowercase= does not apply to --task sft"):
        parse_request({"data": str(docs), "lowercase": True}, "python")


def test_the_python_api_gives_the_commands_rows(tmp_path):
    import unsloth_prep
    from datasets import load_dataset
    from transformers import AutoTokenizer
    src = tmp_path / "chat.jsonl"
    write_records(src, n=80, fmt="alpaca", seed=4)
    p = run("unsloth-prep", "prepare", src, "--tokenizer", tiny_model(), "--out", tmp_path / "cli",
            "--max-seq-length", "512", "--no-progress")
    cli = read_rows(tmp_path / "cli")
    ways = {"path": (str(src), str(tiny_model())),       # (Dataset.from_list would keep only the first row's keys)
            "dataset": (load_dataset("json", data_files=str(src), split="train"), str(tiny_model())),
            "loaded tokenizer": (str(src), AutoTokenizer.from_pretrained(str(tiny_model())))}
    for name, (data, tok) in ways.items():
        ds = unsloth_prep.prepare(data, tok, max_seq_length=512, cache_dir=tmp_path / "cache")
        assert ds["input_ids"] == [r["input_ids"] for r in cli], name
        assert ds["labels"] == [r["labels"] for r in cli], name
    with pytest.raises(ValueError, match="max_seq_length= '0': must be a positive integer"):
        unsloth_prep.prepare(str(src), str(tiny_model()), max_seq_length=0, cache_dir=tmp_path / "cache")
