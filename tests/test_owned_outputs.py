"""A command writes only where it owns: a new path or its own earlier output, never over a user's files and never over
an input, whatever the flags; every derived path goes through the same check; one output shape (the Hub's layout)."""
import json, subprocess
from pathlib import Path

import pytest

from clitools import last_json, read_rows, run as _run
from unsloth_prep.fixtures import tiny_model, write_records


def run(*args, **kw):
    "`unsloth-prep ARGS` in a fresh process, whatever its exit code."
    return _run("unsloth-prep", *args, check=False, **kw)


def refused(proc, *words):
    "Exit 2 with one clear line naming what was refused, and no traceback."
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for w in words: assert w in proc.stderr, (w, proc.stderr[-2000:])


def snapshot(folder: Path) -> dict:
    "Every file under `folder` with its bytes."
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    d = tmp_path_factory.mktemp("owned")
    write_records(d / "chat.jsonl", n=120, fmt="sharegpt", malformed_rate=0.03, seed=7)
    return d / "chat.jsonl"


def prep(data, out, *extra):
    return run("prepare", data, "--tokenizer", tiny_model(), "--out", out, "--on-error", "skip", "--no-progress", *extra)


def test_a_users_folder_is_not_emptied(chat, tmp_path):
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "main.py").write_text("print('hello')\n")
    (proj / "README.md").write_text("# mine\n")
    before = snapshot(proj)
    refused(prep(chat, proj, "--workers", "2"), str(proj), "did not write", "--overwrite")
    assert snapshot(proj) == before


def test_the_model_folder_is_never_an_output(chat, tmp_path):
    model = tmp_path / "model"
    import shutil
    shutil.copytree(tiny_model(), model)
    before = snapshot(model)
    for extra in ([], ["--overwrite"]):
        p = run("prepare", chat, "--tokenizer", model, "--out", model, "--workers", "2", "--no-progress", *extra)
        refused(p, "overwrite the input")
    assert snapshot(model) == before and (model / "model.safetensors").exists()


def test_tiny_model_never_empties_a_folder(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    refused(run("tiny-model", mine), "is not a tiny model")
    assert (mine / "notes.txt").read_text() == "keep me"


def test_a_rejects_file_can_be_prepared_again(chat, tmp_path):
    first = last_json(prep(chat, tmp_path / "first"))
    rejects = Path(first["rejects"])
    assert rejects.parent == tmp_path / "first" and first["rejected"] > 0
    fixed = tmp_path / "fixed.rejects.jsonl"
    fixed.write_bytes(rejects.read_bytes())
    before = fixed.read_bytes()
    p = prep(fixed, tmp_path / "again")
    assert p.returncode in (0, 2) and fixed.read_bytes() == before     # whatever it makes of them, never written to
    refused(prep(rejects, tmp_path / "first"), "overwrite the input")   # its own folder holds the input now
    c = run("convert", fixed, "--out", tmp_path / "conv", "--workers", "2", "--no-progress")
    assert c.returncode == 0, c.stderr[-2000:]
    assert fixed.read_bytes() == before


def test_the_eval_side_never_replaces_the_input(chat, tmp_path):
    raw = tmp_path / "raw.eval.jsonl"
    raw.write_bytes(chat.read_bytes())
    before = raw.read_bytes()
    refused(prep(raw, tmp_path / "raw.parquet", "--eval-fraction", "0.2"), "is a folder")
    s = last_json(prep(raw, tmp_path / "raw", "--eval-fraction", "0.2"))
    assert s["splits"]["validation"] > 0 and raw.read_bytes() == before
    assert len(read_rows(tmp_path / "raw", "validation")) == s["splits"]["validation"]


def test_every_glob_and_a_config_list_are_guarded(chat, tmp_path):
    for i in (1, 2):
        (tmp_path / f"sub{i}").mkdir()
        (tmp_path / f"sub{i}" / "x.jsonl").write_bytes(chat.read_bytes())
    for pattern in ("sub?/x.jsonl", "sub[12]/x.jsonl"):
        refused(prep(str(tmp_path / pattern), tmp_path / "sub1"), "overwrite the input")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"model": {"name": str(tiny_model())}, "max_seq_length": 256, "data": {
        "source": [str(tmp_path / "sub1" / "x.jsonl"), str(tmp_path / "sub2" / "x.jsonl")],
        "path": str(tmp_path / "sub2")}}))
    refused(run("prepare", "--config", cfg, "--on-error", "skip", "--no-progress"), "overwrite the input")
    assert (tmp_path / "sub2" / "x.jsonl").read_bytes() == chat.read_bytes()


def test_a_text_file_is_not_replaced(chat, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    refused(prep(chat, notes), str(notes))
    assert notes.read_text() == "my notes"


def test_rejects_never_land_on_the_output(chat, tmp_path):
    refused(prep(chat, tmp_path / "o", "--rejects", tmp_path / "o"), "inside --out")
    refused(prep(chat, tmp_path / "o", "--rejects", chat), "overwrite the input")
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text("mine\n")
    refused(prep(chat, tmp_path / "o", "--rejects", theirs), "did not write")
    s = last_json(prep(chat, tmp_path / "o", "--rejects", tmp_path / "r.jsonl"))
    again = last_json(prep(chat, tmp_path / "o", "--rejects", tmp_path / "r.jsonl", "--max-seq-length", "512"))
    assert s["rejects"] == again["rejects"] == str(tmp_path / "r.jsonl")    # its own earlier rejects file: replaced
    assert theirs.read_text() == "mine\n"


def test_the_split_keeps_its_rejects(chat, tmp_path):
    s = last_json(prep(chat, tmp_path / "o", "--eval-fraction", "0.2"))
    lines = [json.loads(l)["line"] for l in open(s["rejects"])]
    assert s["rejected"] == len(lines) > 0 and lines == sorted(lines)


def test_one_output_shape_that_datasets_reads(chat, tmp_path):
    from datasets import load_dataset
    refused(prep(chat, tmp_path / "pw.parquet", "--workers", "2"), "is a folder", str(tmp_path / "pw"))
    s = last_json(prep(chat, tmp_path / "pw", "--workers", "2", "--eval-fraction", "0.1"))
    assert s["layout"] == "hub" and s["out"] == str(tmp_path / "pw")
    ds = load_dataset(str(tmp_path / "pw"))
    assert ds["train"].num_rows == s["splits"]["train"] and ds["validation"].num_rows == s["splits"]["validation"]


def test_overwrite_replaces_a_users_folder_when_asked(chat, tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "old.txt").write_text("old")
    s = last_json(prep(chat, proj, "--overwrite"))
    assert s["rows"] > 0 and not (proj / "old.txt").exists() and (proj / "_manifest.json").exists()


def test_two_runs_on_one_output(chat, tmp_path):
    "While one run holds the output (the lock every run takes on its build folder), a second stops at once."
    from unsloth_prep.outputs import build_dir, hold
    out = tmp_path / "o"
    with hold(build_dir(out), out):                      # what a running `prepare` holds until it is done
        refused(prep(chat, out, "--workers", "2"), "another unsloth-prep run is writing this output")
        assert not out.exists()
    s = last_json(prep(chat, out, "--workers", "2"))      # released: the next run builds it
    assert s["rows"] == len(read_rows(out)) > 0


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(chat, tmp_path):
    import resource, signal
    def small_files():   # every file this process (and its workers) writes is cut at 64 KB: writing fails as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    big = tmp_path / "big.jsonl"
    write_records(big, n=2000, fmt="openai", seed=2)
    p = subprocess.run(["unsloth-prep", "prepare", str(big), "--tokenizer", str(tiny_model()), "--out",
                        str(tmp_path / "o"), "--workers", "2", "--no-progress"], capture_output=True, text=True,
                       preexec_fn=small_files, timeout=600)
    refused(p, "File too large")
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.build").exists()


def test_pretraining_without_eos_leaves_nothing(tmp_path):
    import shutil
    tok = tmp_path / "tok"
    shutil.copytree(tiny_model(), tok, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tok / "special_tokens_map.json").unlink(missing_ok=True)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(20)) + "\n")
    p = run("prepare", corpus, "--task", "pretrain", "--tokenizer", tok, "--out", tmp_path / "b", "--block-size", "16",
            "--no-progress")
    refused(p, "eos_token")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.jsonl", "tok"]


def test_many_small_files_are_a_few_shards(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(600):
        (d / f"{i:04d}.jsonl").write_text(json.dumps({"instruction": f"say {i}", "output": f"{i}"}) + "\n")
    s = last_json(prep(str(d / "*.jsonl"), tmp_path / "o", "--workers", "2"))
    assert s["shards"] == 2 and s["records"] == 600 and s["rows"] == 600
    assert len(read_rows(tmp_path / "o")) == 600
