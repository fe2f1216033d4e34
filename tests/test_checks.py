"""One registry of checks: `doctor --config`, `plan --config` and `train` (stopped by its pre-run check) report the same
finding, with the same code and severity, for the same problem in the same config (each in a fresh process); and
every registered check fires on the config that has the problem and stays quiet on the one that does not."""
import re

import pytest
import yaml

from clitools import last_json, run
from unsloth_prep.checks import CHECKS, Context, run_checks
import unsloth_prep.oom  # noqa: F401  (registers the config checks that need the memory estimate)
from unsloth_prep.config import load_config
from unsloth_prep.fixtures import write_records

LINE = re.compile(r"^(ERROR|WARNING|INFO)\s+(\w+):", re.M)
BASE = {"data": {"path": "prepared.parquet"}, "model": {"name": "llama-3.1-8b", "gpu": "T4"}, "max_seq_length": 2048,
        "trainer": {"per_device_train_batch_size": 1}}
PROBLEMS = {  # config change -> the findings every command must report (code: severity)
    "does_not_fit": ({"model": {"name": "llama-3.1-8b", "gpu": "T4", "load_in_4bit": False}, "max_seq_length": 8192,
                      "trainer": {"per_device_train_batch_size": 8}}, {"config_does_not_fit": "error"}),
    "bf16_on_t4": ({"model": {"name": "llama-3.1-8b", "gpu": "T4", "dtype": "bfloat16", "trust_remote_code": True}},
                   {"bf16_unsupported": "error", "trust_remote_code": "warning"}),
    "grouping": ({"packing": True, "trainer": {"per_device_train_batch_size": 64, "group_by_length": True,
                                               "auto_find_batch_size": True}},
                 {"config_does_not_fit": "error", "group_by_length": "warning", "auto_find_batch_size": "info"}),
}


def printed(text: str) -> dict:
    """code -> severity of the findings a command printed (`SEVERITY code: ...` lines)."""
    return {code: sev.lower() for sev, code in LINE.findall(text)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "clean.jsonl"
    write_records(p, n=20, seed=5)
    return p


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_doctor_plan_and_train_report_the_same_code(name, data, tmp_path):
    change, expected = PROBLEMS[name]
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, **change}))
    doc = run("unsloth-prep", "doctor", data, "--config", cfg, check=False)
    plan = run("unsloth-prep", "plan", "--config", cfg)
    train = run("unsloth-prep", "train", cfg, check=False)
    d, p = last_json(doc), last_json(plan)
    assert doc.returncode == 1 and {f["code"]: f["severity"] for f in d["findings"]} == expected, doc.stdout[-2000:]
    assert {f["code"]: f["severity"] for f in p["findings"]} == expected, plan.stdout[-2000:]
    assert printed(doc.stdout) == printed(plan.stdout) == printed(train.stdout) == expected, train.stdout[-2000:]
    assert train.returncode == 2 and "Traceback" not in train.stderr
    for code, sev in expected.items():  # train stops on the errors and names them
        assert (code in last_json(train)["error"]) == (sev == "error")


def cfg_(**kw):
    c = {**BASE, **kw}
    return load_config(c)


@pytest.mark.parametrize("code, fires, quiet", [
    ("config_does_not_fit", dict(trainer={"per_device_train_batch_size": 64}), {}),
    ("bf16_unsupported", dict(model={"name": "llama-3.1-8b", "gpu": "T4", "dtype": "bfloat16"}),
     dict(model={"name": "llama-3.1-8b", "gpu": "A100-80GB", "dtype": "bfloat16"})),
    ("trust_remote_code", dict(model={"name": "llama-3.1-8b", "trust_remote_code": True}), {}),
    ("group_by_length", dict(packing=True, trainer={"group_by_length": True}), dict(packing=True)),
    ("auto_find_batch_size", dict(trainer={"auto_find_batch_size": True}), dict(trainer={"auto_find_batch_size": False})),
])
def test_config_check_fires_and_stays_quiet(code, fires, quiet):
    assert [f.code for f in run_checks(Context(cfg=cfg_(**fires)), {code})] == [code]
    assert run_checks(Context(cfg=cfg_(**quiet)), {code}) == []


def test_no_check_fires_on_a_good_config():
    assert run_checks(Context(cfg=cfg_())) == []


def test_registry_is_complete():
    # every registered check has a severity, a message and a fix; the functions are the ones the commands run
    for c in CHECKS.values():
        assert c.severity in ("error", "warning", "info") and c.message and c.fix, c.code
    assert {"config_does_not_fit", "bf16_unsupported", "no_pad_token", "truncated"} <= {c.code for c in CHECKS.values() if c.fn}
