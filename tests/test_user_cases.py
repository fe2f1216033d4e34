"""Cases a new (and careless) user meets, each in a fresh process where the command is what they ran: the command
ends with a correct result or exit 2 naming the option, path or record; nothing is left behind."""
import json, os, resource, signal, subprocess, time
from pathlib import Path

import pytest

from clitools import last_json, read_rows, run

SEPARATORS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"   # every line break `str.splitlines` knows besides "\n"


def _small_files(limit_mb: int = 16):
    "A child's file size limit: a command that writes without end is stopped (SIGXFSZ) instead of filling the disk."
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit_mb << 20, limit_mb << 20))


@pytest.mark.parametrize("fmt", ["alpaca", "text"])
def test_generate_malformed_rate_one_ends(tmp_path, fmt):
    "`generate --malformed-rate 1` asked for a malformed line before every good one, forever: exit 2 naming it."
    proc = subprocess.run(["unsloth-prep", "generate", tmp_path / "x.jsonl", "--n", "3", "--format", fmt,
                           "--malformed-rate", "1"], capture_output=True, text=True, timeout=120,
                          preexec_fn=_small_files())
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "--malformed-rate" in last_json(proc)["error"] and "Traceback" not in proc.stderr
    ok = last_json(run("unsloth-prep", "generate", tmp_path / "y.jsonl", "--n", "20", "--format", fmt,
                       "--malformed-rate", "0.5"))
    assert ok["records"] == 20 and ok["malformed"] > 0       # a rate below 1 still plants malformed lines


def test_bom_is_not_text(tmp_path):
    "A corpus saved with a UTF-8 BOM (Notepad, Excel) gives the documents and blocks the same file without it gives."
    import gzip
    from unsloth_prep.fixtures import tiny_model
    from unsloth_prep.pretrain import iter_documents
    text = "First paragraph of the corpus.\n\nSecond paragraph, another line.\nThird line.\n"
    for bom in ("", "\ufeff"):
        d = tmp_path / ("bom" if bom else "plain")
        d.mkdir()
        (d / "a.txt").write_text(bom + text, encoding="utf-8")
        (d / "b.txt.gz").write_bytes(gzip.compress((bom + text).encode()))
        (d / "c.jsonl").write_text(bom + json.dumps({"text": text}) + "\n", encoding="utf-8")
        (d / "d.csv").write_text(bom + "text\n" + json.dumps(text) + "\n", encoding="utf-8")
    for mode in ("file", "paragraph", "line"):
        got = [[t for _, _, t in iter_documents(tmp_path / d, txt_mode=mode)] for d in ("plain", "bom")]
        assert got[1] == got[0] and not any(t.startswith("\ufeff") for t in got[1]), mode
    model = tiny_model()
    rows = []
    for d in ("plain", "bom"):
        out = tmp_path / f"{d}_blocks"
        run("unsloth-prep", "prepare", tmp_path / d / "a.txt", "--task", "pretrain", "--tokenizer", model,
            "--out", out, "--block-size", "16")
        rows.append(read_rows(out, columns=["input_ids"]))
    assert rows[1] == rows[0] and len(rows[0]) > 1


def test_output_lines_survive_splitlines(tmp_path):
    "A record holding every line separator: `stdout.splitlines()` sees the lines print wrote; the last is the JSON."
    from unsloth_prep.cli import finish
    src = tmp_path / f"odd{SEPARATORS[1]}name.jsonl"
    rec = {"instruction": "a" + "b".join(SEPARATORS) + "z", "output": "ok\u2028done"}
    src.write_text(json.dumps(rec, ensure_ascii=False) + "\n" + '{"bad\u2028key": 1\n', encoding="utf-8")
    proc = run("unsloth-prep", "inspect", src)
    assert proc.stdout.splitlines() == proc.stdout.rstrip("\n").split("\n")
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["example"]["messages"][0]["content"] == rec["instruction"]
    assert summary["files"] == [str(src)] and summary["malformed"] == 1
    line = finish({"text": SEPARATORS}, time.perf_counter())
    assert len(line.splitlines()) == 1 and json.loads(line)["text"] == SEPARATORS


@pytest.mark.parametrize("argv", [["inspect", "{src}"], ["generate", "{out}", "--n", "2000"], ["--help"]])
def test_stdout_closed_by_reader(tmp_path, argv):
    "`unsloth-prep ... | head -1`: the reader has gone before the command writes; it exits quietly, no traceback."
    src = tmp_path / "x.jsonl"
    run("unsloth-prep", "generate", src, "--n", "50")
    argv = [a.format(src=src, out=tmp_path / "y.jsonl") for a in argv]
    proc = subprocess.Popen(["unsloth-prep", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                                   # the reader is gone before the first line is written
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "Exception ignored" not in err and "Broken pipe" not in err, err[-2000:]
    assert err.strip() == "", err[-2000:]
    assert proc.returncode == (0 if argv == ["--help"] else 128 + signal.SIGPIPE)


def _tokenized(path, lengths, row_group_size=None):
    "A tokenized Parquet file whose rows have these `input_ids` lengths."
    import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32) % 4000))
    pq.write_table(pa.table({"input_ids": ids, "labels": ids}), path, row_group_size=row_group_size)
    return path


def test_pack_every_row_too_long(tmp_path):
    "`pack --max-seq-length 4` when every row is longer: exit 2 naming the option and the shortest row, no output."
    src = _tokenized(tmp_path / "tok.parquet", [9, 7, 12, 6, 30])
    proc = run("unsloth-prep", "pack", src, "--out", tmp_path / "p", "--max-seq-length", "4", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    err = last_json(proc)["error"]
    assert "--max-seq-length" in err and "row 3" in err and "6 tokens" in err, err
    assert not (tmp_path / "p").exists() and sorted(os.listdir(tmp_path)) == ["tok.parquet"]
    # a row group whose rows are all too long, next to one that fits: those rows dropped and counted
    both = _tokenized(tmp_path / "both.parquet", [9] * 1500 + [3] * 600, row_group_size=1024)
    s = last_json(run("unsloth-prep", "pack", both, "--out", tmp_path / "q", "--max-seq-length", "4"))
    assert s["rejected"] == 1500 and s["examples_packed"] == 600 and s["rows"] == 600
    assert len(read_rows(tmp_path / "q")) == 600 and s["rejects"] == str(tmp_path / "q" / "rejects.parquet")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    "A prepared output in shards with its manifest (`prepare --workers 2`), from generated conversations."
    from unsloth_prep.fixtures import tiny_model
    d = tmp_path_factory.mktemp("shards")
    run("unsloth-prep", "generate", d / "chat.jsonl", "--n", "50", "--seed", "4")
    run("unsloth-prep", "prepare", d / "chat.jsonl", "--tokenizer", tiny_model(), "--out", d / "prep", "--workers", "2")
    return d / "prep"


def test_pack_shard_replaced_by_shorter_file(shards, tmp_path):
    "A shard file replaced by a shorter one (29 of 50 examples): exit 2 naming the file and the manifest's count."
    import shutil, pyarrow.parquet as pq
    from unsloth_prep.base import MANIFEST
    from unsloth_prep.outputs import data_files
    prep = tmp_path / "prep"
    shutil.copytree(shards, prep)
    first = data_files(prep)[0]
    t = pq.read_table(first)
    pq.write_table(t.slice(0, t.num_rows // 2), first)
    proc = run("unsloth-prep", "pack", prep, "--out", tmp_path / "p", "--max-seq-length", "2048", check=False)
    err = last_json(proc).get("error", "")
    assert proc.returncode == 2 and str(first) in err and f"{t.num_rows} rows" in err, (proc.returncode, err)
    assert "changed after the run" in err and not (tmp_path / "p").exists()
    # the same rows written again (another size than the manifest records): refused as well
    pq.write_table(t, first)
    m = json.loads((prep / MANIFEST).read_text())
    for f in m["splits"]["train"]["files"]: f["bytes"] = 123
    (prep / MANIFEST).write_text(json.dumps(m))
    err = last_json(run("unsloth-prep", "pack", prep, "--out", tmp_path / "p", "--max-seq-length", "2048",
                        check=False))["error"]
    assert str(first) in err and "123 bytes" in err, err


def test_pack_killed_leaves_nothing_for_the_next_run(tmp_path):
    "kill -9 of `pack` while it writes: only its build folder is left, and the next run leaves nothing but its output."
    import numpy as np
    src = _tokenized(tmp_path / "tok.parquet", np.random.default_rng(0).integers(8, 60, 300_000), 50_000)
    dst = tmp_path / "packed"
    proc = subprocess.Popen(["unsloth-prep", "pack", src, "--out", dst, "--max-seq-length", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    build, t0 = tmp_path / ".packed.build", time.monotonic()
    while not any(build.glob("*.tmp-*")):                  # the packed rows are being written
        assert proc.poll() is None, f"pack ended (exit {proc.returncode}) before it was killed"
        assert time.monotonic() - t0 < 120
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".packed.build", "tok.parquet"]   # nothing at the output
    s = last_json(run("unsloth-prep", "pack", src, "--out", dst, "--max-seq-length", "64"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed", "tok.parquet"] and s["rows"] > 0
    assert sorted(p.name for p in dst.iterdir()) == ["README.md", "_manifest.json", "train-00000-of-00001.parquet"]


def _shadow_clone(folder: Path) -> Path:
    "A folder holding a directory named `unsloth_prep` with an unrelated package in it (an older clone, say)."
    (folder / "unsloth_prep").mkdir(parents=True)
    (folder / "unsloth_prep" / "__init__.py").write_text("raise ImportError('the clone, not the installed package')\n")
    return folder


def test_demo_stages_import_the_installed_package(tmp_path, monkeypatch):
    """`demo` from the folder holding a clone named `unsloth_prep`: stages still run the installed package, and each
    task keeps its own folder and report."""
    from unsloth_prep import demo
    monkeypatch.chdir(_shadow_clone(tmp_path))

    def stages(stage, out, records, seed, max_seq_length, steps):
        gen = stage("generate", "generate", out / "data.jsonl", "--n", records, "--seed", seed)
        code = ("import json, unsloth_prep.fixtures as f; print(json.dumps({'module': f.__file__, 'steps': 3, "
                "'losses': [3.0, 2.5, 2.0], 'adapter': None, 'seconds': 0.1, 'peak_rss_mb': 1.0}))")
        trained = stage("train", cmd=demo.python_cmd(code))      # a stand-in for training, in a fresh process
        return {"data": gen["path"], "module": trained["module"]}
    monkeypatch.setitem(demo.DEMO_TASKS, "sft", (stages, 5, 64, 3))
    monkeypatch.setitem(demo.DEMO_TASKS, "dpo", (stages, 7, 64, 3))
    out = tmp_path / "demo_out"
    runs = {task: demo.run_demo(out, task=task) for task in ("sft", "dpo")}
    for task, s in runs.items():
        folder, n = out / task, {"sft": 5, "dpo": 7}[task]
        assert s["out"] == str(folder) and s["report"] == str(folder / "report.json"), s
        assert Path(s["artefacts"]["module"]).resolve() == Path(demo.__file__).resolve().parent / "fixtures.py"
        report = json.loads((folder / "report.json").read_text())
        assert report["task"] == task and report["stages"]["generate"]["summary"]["records"] == n
        assert (folder / "report.png").exists() and (folder / "logs" / "generate.log").exists()
        assert sum(1 for _ in open(folder / "data.jsonl")) == n
        assert report["losses"] == [3.0, 2.5, 2.0] and report["loss_steps"] == [1, 2, 3]


def test_too_few_lines_for_the_workers(shards, tmp_path):
    "`--workers 64` on an 8-line JSONL file: 8 shards, and the note says why (8 lines), not 'a JSON array'."
    from unsloth_prep.fixtures import tiny_model
    src = tmp_path / "eight.jsonl"
    src.write_text("".join((shards.parent / "chat.jsonl").read_text().splitlines(keepends=True)[:8]))
    conv = run("unsloth-prep", "convert", src, "--out", tmp_path / "c", "--workers", "64")
    prep = run("unsloth-prep", "prepare", src, "--tokenizer", tiny_model(), "--out", tmp_path / "p", "--workers", "64")
    for proc in (conv, prep):
        n = last_json(proc)["shards"]
        assert 0 < n <= 8 and "JSON array" not in proc.stderr and "compressed" not in proc.stderr, proc.stderr[-2000:]
        assert f"{src}: {n} shards, not 64: {src} has 8 lines" in proc.stderr, proc.stderr[-2000:]
