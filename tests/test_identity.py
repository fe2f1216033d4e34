"""Reuse is decided by content: a run killed after some shards resumes only while the bytes of its input, the
tokenizer's files and the options are the ones the shards were made from; the same run twice is a cache hit."""
import json, os, shutil, signal, subprocess, time
from pathlib import Path

import pytest

from clitools import last_json, run as _run
from unsloth_prep.fixtures import tiny_model, write_records
from unsloth_prep.outputs import build_dir, data_files
from unsloth_prep.parallel import rows_digest


def prepare(data, out, tok, *extra):
    p = _run("unsloth-prep", "prepare", data, "--tokenizer", tok, "--out", out, "--on-error", "skip", "--no-progress",
             "--shards", "6", *extra, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    return last_json(p)


def kill_after_first_shard(data, out, tok, timeout=300):
    "Start a run of 6 shards, SIGKILL it as soon as its journal records one."
    argv = ["unsloth-prep", "prepare", str(data), "--tokenizer", str(tok), "--out", str(out), "--on-error", "skip",
            "--no-progress", "--shards", "6"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal, t0 = build_dir(out) / "_journal.jsonl", time.monotonic()
    try:
        while not (journal.exists() and journal.read_text().count("\n") >= 1):
            assert proc.poll() is None, f"the run ended before a shard was recorded (exit {proc.returncode})"
            assert time.monotonic() - t0 < timeout
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally: proc.wait()
    assert build_dir(out).exists() and not Path(out).exists()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("identity")
    write_records(d / "chat.jsonl", n=6000, fmt="openai", malformed_rate=0.005, seed=3)
    tok = d / "tok"
    shutil.copytree(tiny_model(), tok, ignore=shutil.ignore_patterns("*.safetensors"))
    return d, tok


def digest(out):
    return rows_digest(data_files(out))


def test_resume_reuses_shards_of_the_same_content(setup, tmp_path):
    d, tok = setup
    fresh = prepare(d / "chat.jsonl", tmp_path / "fresh", tok)
    kill_after_first_shard(d / "chat.jsonl", tmp_path / "o", tok)
    s = prepare(d / "chat.jsonl", tmp_path / "o", tok)
    assert s["reused_shards"] >= 1 and digest(tmp_path / "o") == digest(tmp_path / "fresh")
    assert (s["rows"], s["rejected"]) == (fresh["rows"], fresh["rejected"])
    again = prepare(d / "chat.jsonl", tmp_path / "o", tok)
    assert again["up_to_date"] and again["reused_shards"] == again["shards"] == 6


def test_an_edited_chat_template_reuses_nothing(setup, tmp_path):
    d, tok0 = setup
    tok = tmp_path / "tok"
    shutil.copytree(tok0, tok)
    kill_after_first_shard(d / "chat.jsonl", tmp_path / "o", tok)
    jinja = tok / "chat_template.jinja"                              # same path, another template: other rows
    jinja.write_text(jinja.read_text().replace("<|im_start|>", "<|im_start|> "))
    s = prepare(d / "chat.jsonl", tmp_path / "o", tok)
    fresh = prepare(d / "chat.jsonl", tmp_path / "fresh", tok)
    assert s["reused_shards"] == 0 and digest(tmp_path / "o") == digest(tmp_path / "fresh")
    assert digest(tmp_path / "o") != digest(prepare(d / "chat.jsonl", tmp_path / "before", tok0)["out"])


def test_an_input_edited_in_place_with_its_size_and_mtime_kept(setup, tmp_path):
    d, tok = setup
    data = tmp_path / "chat.jsonl"
    shutil.copy2(d / "chat.jsonl", data)
    kill_after_first_shard(data, tmp_path / "o", tok)
    raw, st = bytearray(data.read_bytes()), data.stat()
    i = raw.index(b'"content": "') + len(b'"content": "')
    raw[i] = ord("X") if raw[i] != ord("X") else ord("Y")        # one character of the first record: same size
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))        # what `cp -p` / `rsync -t` keep
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    s = prepare(data, tmp_path / "o", tok)
    fresh = prepare(data, tmp_path / "fresh", tok)
    assert s["reused_shards"] == 0 and digest(tmp_path / "o") == digest(tmp_path / "fresh")


def test_an_option_that_changes_rows_is_another_run(setup, tmp_path):
    d, tok = setup
    a = prepare(d / "chat.jsonl", tmp_path / "o", tok, "--max-seq-length", "512")
    b = prepare(d / "chat.jsonl", tmp_path / "o", tok, "--max-seq-length", "256")
    assert not b["up_to_date"] and b["reused_shards"] == 0 and b["truncated"] >= a["truncated"]
    c = prepare(d / "chat.jsonl", tmp_path / "o", tok, "--max-seq-length", "256", "--workers", "2")
    assert c["up_to_date"]                  # the worker count changes no row: the output is reused as it is
