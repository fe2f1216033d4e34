"""One pipeline for every task: `prepare --task T` with one process, `--workers 2`, Ray and an eval split gives the
same rows; options mean the same everywhere and are refused by name where they do not apply; a killed run resumes."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from clitools import last_json, run as _run
from unsloth_prep.base import prepared_settings, shard_paths
from unsloth_prep.fixtures import iter_pairs, tiny_model, write_corpus, write_records
from unsloth_prep.parallel import build_dir, rows_digest

TASKS = ("sft", "dpo", "kto", "pretrain")


def run(*args):
    "`unsloth-prep ARGS` in a fresh process, whatever its exit code."
    return _run("unsloth-prep", *args, check=False)
COLUMNS = {"sft": ("input_ids", "labels"), "dpo": ("prompt_ids", "chosen_ids", "rejected_ids"),
           "kto": ("prompt_ids", "completion_ids"), "pretrain": ("input_ids", "labels")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipeline")
    write_records(d / "sft.jsonl", n=400, fmt="sharegpt", malformed_rate=0.01, seed=3)
    pairs = [r for _, r in iter_pairs(300, seed=4)]
    (d / "dpo.jsonl").write_text("\n".join(json.dumps(r) for r in pairs) + "\n")
    kto = [{"prompt": r["prompt"], "completion": r["chosen"], "label": i % 3 != 0} for i, r in enumerate(pairs)]
    (d / "kto.jsonl").write_text("\n".join(json.dumps(r) for r in kto) + "\n")
    write_corpus(d / "pretrain.jsonl", 300, seed=5)
    return d


def prepare(data_dir, task, out, *extra):
    argv = ["prepare", str(data_dir / f"{task}.jsonl"), "--task", task, "--tokenizer", str(tiny_model()),
            "--out", str(out), "--max-seq-length", "256", "--on-error", "skip", "--no-progress", *extra]
    r = run(*argv)
    assert r.returncode == 0, r.stderr[-2000:]
    return last_json(r)


def digest(task, out):
    return rows_digest(shard_paths(out), COLUMNS[task])


@pytest.mark.parametrize("task", TASKS)
def test_workers_give_the_single_process_rows(data, tmp_path, task):
    one = prepare(data, task, tmp_path / "one.parquet")
    two = prepare(data, task, tmp_path / "two", "--workers", "2")
    assert one["rows"] > 0 and one["records"] == two["records"] and one["rows"] == two["rows"]
    assert digest(task, tmp_path / "one.parquet") == digest(task, two["out"])
    assert two["workers"] == 2 and one["task"] == two["task"] == task
    settings = prepared_settings(tmp_path / "one.parquet")
    assert settings["task"] == task and settings["max_seq_length"] == 256


@pytest.mark.parametrize("task", TASKS)
def test_eval_split_for_every_task(data, tmp_path, task):
    s = prepare(data, task, tmp_path / "split.parquet", "--eval-fraction", "0.1")
    assert s["split"]["train"] > 0 and s["split"]["eval"] > 0 and s["rows"] > 0 and s["eval"]["rows"] > 0
    train = {tuple(r) for r in pq.read_table(s["out"]).column(COLUMNS[task][0]).to_pylist()}
    held = {tuple(r) for r in pq.read_table(s["eval_out"]).column(COLUMNS[task][0]).to_pylist()}
    if task != "pretrain": assert not train & held, "an eval row is also a train row"
    two = prepare(data, task, tmp_path / "split2.parquet", "--eval-fraction", "0.1", "--workers", "2")
    assert digest(task, s["out"]) == digest(task, two["out"]) and digest(task, s["eval_out"]) == digest(task, two["eval_out"])


def test_ray_engine_gives_the_same_rows_for_every_task(data, tmp_path):
    from unsloth_prep.cli import main
    from contextlib import redirect_stdout
    import io
    for task in TASKS:
        buf = io.StringIO()
        argv = ["prepare", str(data / f"{task}.jsonl"), "--task", task, "--tokenizer", str(tiny_model()),
                "--max-seq-length", "256", "--on-error", "skip", "--no-progress"]
        with redirect_stdout(buf): assert main(argv + ["--out", str(tmp_path / f"{task}.parquet")]) == 0
        with redirect_stdout(buf): assert main(argv + ["--out", str(tmp_path / f"{task}_ray"), "--engine", "ray",
                                                       "--workers", "2"]) == 0
        assert digest(task, tmp_path / f"{task}.parquet") == digest(task, tmp_path / f"{task}_ray"), task


def test_one_vocabulary(data, tmp_path):
    r = run("prepare", str(data / "dpo.jsonl"), "--task", "dpo", "--tokenizer", str(tiny_model()), "--out",
            str(tmp_path / "x.parquet"), "--pack")
    assert r.returncode == 2 and "--pack does not apply to --task dpo" in r.stderr and "Traceback" not in r.stderr
    r = run("prepare", str(data / "sft.jsonl"), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "y.parquet"),
            "--max-prompt-length", "9")
    assert r.returncode == 2 and "--max-prompt-length does not apply to --task sft" in r.stderr
    for bad in (["--batch-size", "0"], ["--workers", "-1"], ["--eval-fraction", "1.5"], ["--max-seq-length", "0"]):
        r = run("prepare", str(data / "sft.jsonl"), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "z"), *bad)
        assert r.returncode == 2 and bad[0] in r.stderr, (bad, r.stderr)
    # TRL's name is an alias of the same option
    s = prepare(data, "dpo", tmp_path / "alias.parquet", "--max-length", "128")
    assert prepared_settings(tmp_path / "alias.parquet")["max_seq_length"] == 128 and s["rows"] > 0


def test_output_never_replaces_the_input(data, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes((data / "sft.jsonl").read_bytes())
    before = src.read_bytes()
    for extra in (["--out", str(src)], ["--out", str(tmp_path / "o.parquet"), "--rejects", str(src)],
                  ["--out", str(tmp_path), "--workers", "2"]):
        r = run("prepare", str(src), "--tokenizer", str(tiny_model()), "--on-error", "skip", *extra)
        assert r.returncode == 2 and "would overwrite the input" in r.stderr, (extra, r.stderr)
    assert src.read_bytes() == before


def test_rejects_file_for_every_task(data, tmp_path):
    s = prepare(data, "sft", tmp_path / "r.parquet")
    assert s["rejected"] > 0 and s["rejects"] and len(Path(s["rejects"]).read_text().splitlines()) == s["rejected"]


def _pids_of(out_dir: Path) -> list:
    "Processes whose command line mentions the run's output (the parent and its spawned workers)."
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit(): continue
        try: cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError: continue
        if "multiprocessing" in cmd or str(out_dir) in cmd: found.append((int(p.name), cmd))
    return found


def _children(pid: int) -> list:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit(): continue
        try: stat = (p / "stat").read_text()
        except OSError: continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid: out.append(int(p.name))
    return out


def _alive(pid: int) -> bool:
    try: state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError: return False
    return state != "Z"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    write_records(d / "big.jsonl", size_mb=6, fmt="openai", seed=8)
    return d / "big.jsonl"


def _start(big, out, *extra):
    argv = ["unsloth-prep", "prepare", str(big), "--tokenizer", str(tiny_model()),
            "--out", str(out), "--workers", "2", "--shards", "8", "--no-progress", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_shards(out, n: int, proc, limit: float = 120):
    journal = build_dir(out) / "_journal.jsonl"
    t0 = time.time()
    while time.time() - t0 < limit and proc.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= n: return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killed_run_leaves_no_worker_and_resumes(big, tmp_path, sig):
    ref = run("prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "ref"), "--workers", "2",
              "--shards", "8", "--no-progress")
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / "out"
    proc = _start(big, out)
    assert _wait_for_shards(out, 2, proc), "no shard completed"
    workers = _children(proc.pid)
    proc.send_signal(sig)
    proc.wait(timeout=30)
    t0 = time.time()
    while any(_alive(w) for w in workers) and time.time() - t0 < 5: time.sleep(0.1)
    assert not [w for w in workers if _alive(w)], "a worker outlived its parent"
    assert not out.exists(), "the destination must hold nothing new"
    if sig != signal.SIGKILL:
        assert proc.returncode == 128 + sig and "Traceback" not in proc.stderr.read()
    again = run("prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(out), "--workers", "2",
                "--shards", "8", "--no-progress")
    s = last_json(again)
    assert again.returncode == 0 and s["reused_shards"] >= 2, s
    assert rows_digest(shard_paths(out)) == rows_digest(shard_paths(tmp_path / "ref"))
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "ref"))
    assert not build_dir(out).exists()


def test_changed_setting_redoes_everything(big, tmp_path):
    a = last_json(run("prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "o"),
                      "--workers", "2", "--shards", "4", "--no-progress"))
    out = tmp_path / "p"
    proc = _start(big, out, "--max-seq-length", "128")
    assert _wait_for_shards(out, 1, proc)
    proc.kill()
    proc.wait()
    s = last_json(run("prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(out), "--workers", "2",
                      "--shards", "8", "--no-progress", "--max-seq-length", "64"))
    assert s["reused_shards"] == 0 and a["reused_shards"] == 0
