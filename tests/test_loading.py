"""Loading: the `inspect` CLI in fresh processes, bounded memory on a large generated file, no-loss sharding."""
import json, os, subprocess, sys
from pathlib import Path

import pytest

from unsloth_prep.fixtures import write_records
from unsloth_prep.loading import iter_json_array, iter_jsonl, load_conversations, plan_shards, iter_file, stream_hash


def run_cli(*args, env=None):
    "Run `unsloth-prep ...` in a fresh process; return (exit code, last JSON line as dict, stdout, stderr)."
    proc = subprocess.run(["unsloth-prep", *map(str, args)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    last = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    return proc.returncode, (json.loads(last[-1]) if last else None), proc.stdout, proc.stderr


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt", "openai"])
def test_inspect_jsonl_with_malformed(tmp_path, fmt):
    info = write_records(tmp_path / "d.jsonl", n=500, fmt=fmt, malformed_rate=0.02, seed=1)
    code, s, out, err = run_cli("inspect", info["path"], "--rejects", tmp_path / "rej.jsonl")
    assert code == 0, err
    assert (s["format"], s["records"], s["malformed"], s["invalid"]) == (fmt, info["records"], info["malformed"], 0)
    assert s["seconds"] >= 0 and s["peak_rss_mb"] > 0
    rej_lines = [json.loads(l)["line"] for l in (tmp_path / "rej.jsonl").read_text().splitlines()]
    assert rej_lines[:1000] == info["malformed_lines"]


def test_inspect_json_array_gz_and_format_override(tmp_path):
    info = write_records(tmp_path / "a.json.gz", n=300, fmt="sharegpt", layout="json_array", gzip=True, seed=2)
    code, s, _, err = run_cli("inspect", info["path"], "--format", "sharegpt")
    assert code == 0, err
    assert (s["format"], s["records"], s["malformed"]) == ("sharegpt", 300, 0)
    assert s["example"]["messages"][-1]["role"] == "assistant"


def test_inspect_dataset_info(tmp_path):
    write_records(tmp_path / "sg.json", n=40, fmt="sharegpt", layout="json_array", seed=3)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "sg.json", "formatting": "sharegpt",
                                                                     "columns": {"messages": "conversations"}, "num_samples": 25}}))
    code, s, _, err = run_cli("inspect", "--dataset-info", tmp_path / "dataset_info.json", "--name", "mine")
    assert code == 0, err
    assert (s["format"], s["records"]) == ("sharegpt", 25)
    code, s, _, err = run_cli("inspect", "--dataset-info", tmp_path, "--name", "other")
    assert code == 2 and "no dataset named 'other'" in err and "mine" in err


def test_inspect_errors_exit_2(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"foo": 1, "bar": 2}) + "\n")
    code, s, _, err = run_cli("inspect", tmp_path / "x.jsonl")
    assert code == 2 and "x.jsonl: cannot detect the format" in err and "bar" in err
    code, _, _, err = run_cli("inspect", tmp_path / "missing.jsonl")
    assert code == 2 and "missing.jsonl" in err
    (tmp_path / "a.json").write_text('[{"instruction": "q", "output": "a"},\n{"instruction": "q2", "output": ]')
    code, _, _, err = run_cli("inspect", tmp_path / "a.json")
    assert code == 2 and "a.json: JSON array not closed (truncated after element 1)" in err


def test_null_first_line_does_not_crash(tmp_path):
    "pyarrow segfaults on a leading `null` line; our reader reports it."
    (tmp_path / "n.jsonl").write_text('null\n{"text": "a"}\n')
    code, s, _, err = run_cli("inspect", tmp_path / "n.jsonl")
    assert code == 0 and (s["format"], s["records"], s["malformed"]) == ("text", 1, 1)


def test_large_file_bounded_memory(tmp_path):
    "A ~150 MB JSONL and JSON array stream through the readers with a flat peak (fresh process each)."
    from unsloth_prep.memory import run_code
    j = write_records(tmp_path / "big.jsonl", size_mb=150, fmt="alpaca", seed=4, huge_every=5000)
    write_records(tmp_path / "big.json", n=j["records"], fmt="alpaca", seed=4, huge_every=5000, layout="json_array")
    def peaks():
        res = {}
        for name in ("big.jsonl", "big.json"):
            code = ("import os; os.environ['USE_TORCH'] = '0'\nfrom unsloth_prep.loading import load_conversations\n"
                    f"result = sum(1 for _ in load_conversations({str(tmp_path / name)!r}))")
            res[name] = run_code(code, label=name)
            assert res[name].value == j["records"]
            assert res[name].peak_mb < 300, res[name]
        return res["big.jsonl"].peak_mb, res["big.json"].peak_mb
    a, b = peaks()
    if abs(a - b) / a >= 0.2:   # a busy machine can lift one peak once (249 against 176 MB in one CI run): measure again
        (a2, b2) = peaks()
        a, b = min(a, a2), min(b, b2)
    assert abs(a - b) / a < 0.2, (a, b)


def test_byte_range_shards_are_exact(tmp_path):
    info = write_records(tmp_path / "s.jsonl", n=3000, malformed_rate=0.01, blank_rate=0.01, seed=5)
    whole = list(iter_jsonl(info["path"], on_error="skip", rejects=[]))
    for k in (2, 5, 16):
        got = [x for spec in plan_shards([info["path"]], k) for x in iter_file(spec, on_error="skip", rejects=[])]
        assert got == whole


def test_sharded_processing_no_loss(tmp_path):
    from unsloth_prep.loading import process_sharded, conversation_text
    info = write_records(tmp_path / "p.jsonl", n=2000, fmt="openai", seed=6)
    src = load_conversations(info["path"], num_shards=2)
    out, counts = process_sharded(src, conversation_text, num_proc=2, out_dir=tmp_path / "out")
    assert sum(counts) == 2000
    assert stream_hash(out, ["messages"]) == stream_hash(load_conversations(info["path"]), ["messages"])
