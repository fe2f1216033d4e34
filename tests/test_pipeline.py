"""One pipeline for every task: `prepare --task T` with one process, `--workers 2`, Ray and an eval split gives the
same rows; options mean the same everywhere and are refused by name where they do not apply; a killed run resumes."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import pytest

from clitools import last_json, read_rows, run as _run
from unsloth_prep.fixtures import iter_pairs, tiny_model, write_corpus, write_records
from unsloth_prep.outputs import REJECTS, build_dir, data_files, read_manifest, settings_of
from unsloth_prep.parallel import rows_digest, shard_counts, undeclared
from unsloth_prep.pipeline import STEPS, load_tasks

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


def digest(task, out, split="train"):
    return rows_digest(data_files(out, split), COLUMNS[task])


@pytest.mark.parametrize("task", TASKS)
def test_workers_give_the_single_process_rows(data, tmp_path, task):
    one = prepare(data, task, tmp_path / "one")
    two = prepare(data, task, tmp_path / "two", "--workers", "2")
    assert one["rows"] > 0 and one["records"] == two["records"] and one["rows"] == two["rows"]
    assert digest(task, tmp_path / "one") == digest(task, two["out"])
    assert two["workers"] == 2 and one["task"] == two["task"] == task
    how = {"seconds", "peak_rss_mb", "worker_peak_rss_mb", "publish_seconds", "workers", "shards"}  # not the rows'
    same = {k for k, v in one.items() if isinstance(v, (int, float, str)) and k not in how | {"out", "rejects"}}
    assert {k: one[k] for k in same} == {k: two.get(k) for k in same}   # no value is added up that is not a count
    m = read_manifest(two["out"])
    load_tasks()
    assert not undeclared(STEPS[task], m["shards"], m["splits"])     # each count is added up or the split's own
    figures = set(shard_counts(m["shards"]))
    assert {k: one.get(k) for k in figures} == {k: two.get(k) for k in figures}
    settings = settings_of(tmp_path / "one")
    assert settings["task"] == task and settings["max_seq_length"] == 256


@pytest.mark.parametrize("task", TASKS)
def test_eval_split_for_every_task(data, tmp_path, task):
    s = prepare(data, task, tmp_path / "split", "--eval-fraction", "0.1")
    assert s["split"]["train"] > 0 and s["split"]["eval"] > 0 and s["rows"] > 0 and s["eval"]["rows"] > 0
    col = COLUMNS[task][0]
    train = {tuple(r[col]) for r in read_rows(s["out"], "train", [col])}
    held = {tuple(r[col]) for r in read_rows(s["out"], "validation", [col])}
    assert len(held) > 0 and s["splits"] == {"train": s["rows"], "validation": s["eval"]["rows"]}
    if task != "pretrain": assert not train & held, "an eval row is also a train row"
    two = prepare(data, task, tmp_path / "split2", "--eval-fraction", "0.1", "--workers", "2")
    assert digest(task, s["out"]) == digest(task, two["out"])
    assert digest(task, s["out"], "validation") == digest(task, two["out"], "validation")


def test_ray_engine_gives_the_same_rows_for_every_task(data, tmp_path):
    import ray
    try: _ray_rows(data, tmp_path)
    finally: ray.shutdown()   # the cluster this test started in the test process


def _ray_rows(data, tmp_path):
    from unsloth_prep.cli import main
    from contextlib import redirect_stdout
    import io
    for task in TASKS:
        buf = io.StringIO()
        argv = ["prepare", str(data / f"{task}.jsonl"), "--task", task, "--tokenizer", str(tiny_model()),
                "--max-seq-length", "256", "--on-error", "skip", "--no-progress"]
        with redirect_stdout(buf): assert main(argv + ["--out", str(tmp_path / f"{task}_one")]) == 0
        with redirect_stdout(buf): assert main(argv + ["--out", str(tmp_path / f"{task}_ray"), "--engine", "ray",
                                                       "--workers", "2"]) == 0
        assert digest(task, tmp_path / f"{task}_one") == digest(task, tmp_path / f"{task}_ray"), task


def test_one_vocabulary(data, tmp_path):
    r = run("prepare", str(data / "dpo.jsonl"), "--task", "dpo", "--tokenizer", str(tiny_model()), "--out",
            str(tmp_path / "x"), "--pack")
    assert r.returncode == 2 and "--pack does not apply to --task dpo" in r.stderr and "Traceback" not in r.stderr
    r = run("prepare", str(data / "sft.jsonl"), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "y"),
            "--max-prompt-length", "9")
    assert r.returncode == 2 and "--max-prompt-length does not apply to --task sft" in r.stderr
    for bad in (["--batch-size", "0"], ["--workers", "-1"], ["--eval-fraction", "1.5"], ["--max-seq-length", "0"]):
        r = run("prepare", str(data / "sft.jsonl"), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "z"), *bad)
        assert r.returncode == 2 and bad[0] in r.stderr, (bad, r.stderr)
    # TRL's name is an alias of the same option
    s = prepare(data, "dpo", tmp_path / "alias", "--max-length", "128")
    assert settings_of(tmp_path / "alias")["max_seq_length"] == 128 and s["rows"] > 0


def test_output_never_replaces_the_input(data, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes((data / "sft.jsonl").read_bytes())
    before = src.read_bytes()
    for extra in (["--out", str(src)], ["--out", str(tmp_path / "o"), "--rejects", str(src)],
                  ["--out", str(tmp_path), "--workers", "2"]):
        r = run("prepare", str(src), "--tokenizer", str(tiny_model()), "--on-error", "skip", *extra)
        assert r.returncode == 2 and "would overwrite the input" in r.stderr, (extra, r.stderr)
    assert src.read_bytes() == before


def test_rejects_file_for_every_task(data, tmp_path):
    s = prepare(data, "sft", tmp_path / "r")
    assert s["rejected"] > 0 and s["rejects"] == str(tmp_path / "r" / REJECTS)
    assert len(Path(s["rejects"]).read_text().splitlines()) == s["rejected"]


def _pids_of(out_dir: Path) -> list:
    "Processes whose command line mentions the run's output (the parent and its spawned workers)."
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit(): continue
        try: cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError: continue
        if "multiprocessing" in cmd or str(out_dir) in cmd: found.append((int(p.name), cmd))
    return found


def _proc_stats():
    "`(pid, stat fields after the command name)` of every process now, zombies included."
    for p in Path("/proc").iterdir():
        if not p.name.isdigit(): continue
        try: stat = (p / "stat").read_text()
        except OSError: continue
        yield int(p.name), stat.rsplit(")", 1)[1].split()


def _children(pid: int) -> list:
    return [c for c, fields in _proc_stats() if int(fields[1]) == pid]


def _alive(pid: int) -> bool:
    try: state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError: return False
    return state != "Z"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    write_records(d / "big.jsonl", size_mb=6, fmt="openai", seed=8)
    return d / "big.jsonl"


@pytest.fixture(scope="module")
def reference(big):
    "The uninterrupted run's output, once for the module."
    out = big.parent / "ref"
    r = run("prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(out), "--workers", "2", "--shards", "8",
            "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


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
def test_killed_run_leaves_no_worker_and_resumes(big, reference, tmp_path, sig):
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
    assert rows_digest(data_files(out)) == rows_digest(data_files(reference))
    assert sorted(os.listdir(out)) == sorted(os.listdir(reference))
    assert not build_dir(out).exists()


def test_changed_setting_redoes_everything(big, tmp_path):
    out = tmp_path / "p"
    proc = _start(big, out, "--max-seq-length", "128")
    assert _wait_for_shards(out, 1, proc)
    proc.kill()
    proc.wait()
    s = last_json(run("prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(out), "--workers", "2",
                      "--shards", "8", "--no-progress", "--max-seq-length", "64"))
    assert s["reused_shards"] == 0 and s["rows"] > 0


def test_images_never_read_as_text(tmp_path):
    from unsloth_prep.fixtures import processor_folder, write_vision_records
    info = write_vision_records(tmp_path / "data", n=6, seed=1)
    proc = processor_folder(tmp_path / "proc")
    src = Path(info["path"])
    r = run("prepare", src, "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "t"))
    assert r.returncode == 2 and "field 'images'" in r.stderr and "--drop-images" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "t").exists() and not build_dir(tmp_path / "t").exists()
    s = last_json(run("prepare", src, "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "t"),
                      "--drop-images"))
    assert s["images_dropped"] == info["images"] and s["rows"] == info["records"]
    from unsloth_prep.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_model())
    texts = [tok.decode(r["input_ids"]) for r in read_rows(tmp_path / "t", columns=["input_ids"])]
    assert texts and not any("<image>" in x for x in texts), "a dropped image leaves no placeholder text"
    v = last_json(run("prepare", src, "--tokenizer", str(proc), "--out", str(tmp_path / "v")))
    assert v["images"] == info["images"] and v["image_tokens"] > 0 and v["rows"] == info["records"]
    two = run("prepare", src, "--tokenizer", str(proc), "--out", str(tmp_path / "v2"), "--workers", "2")
    assert "read whole" not in two.stderr and last_json(two)["image_tokens"] == v["image_tokens"]  # the array is cut
    assert read_rows(tmp_path / "v2") == read_rows(tmp_path / "v")
    first = sorted((src.parent / "images").iterdir())[0]
    first.unlink()
    doc = run("doctor", src, "--tokenizer", str(proc))
    assert doc.returncode == 1 and "image_missing" in last_json(doc)["codes"] and first.name in doc.stdout
    bad = run("prepare", src, "--tokenizer", str(proc), "--out", str(tmp_path / "v3"))
    assert bad.returncode == 2 and first.name in bad.stderr and "Traceback" not in bad.stderr


def test_killed_ray_run_leaves_no_process(big, tmp_path):
    "kill -9 of a `--engine ray` run: the driver's local cluster (raylet, agents, actors) is gone within 5 s."
    out = tmp_path / "ray_out"
    proc = _start(big, out, "--engine", "ray")
    assert _wait_for_shards(out, 1, proc, limit=300), "no shard completed"
    tree = _tree(proc.pid)
    assert len(tree) >= 3, tree          # raylet, gcs, agents, actors
    proc.kill()
    proc.wait()
    t0 = time.time()
    while [p for p in tree if _alive(p)] and time.time() - t0 < 5: time.sleep(0.1)
    assert not [p for p in tree if _alive(p)], "a process of the Ray run outlived the command"
    assert not out.exists()
    again = last_json(run("prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(out), "--workers", "2",
                          "--shards", "8", "--no-progress", "--engine", "ray"))
    assert again["reused_shards"] >= 1


def _tree(pid: int) -> list:
    "Every process below `pid` now."
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def test_kill_9_leaves_nothing_a_rerun_does_not_clean(big, tmp_path):
    "After kill -9 of a one-process run, a rerun leaves only the output folder (its rejects inside it)."
    out = tmp_path / "x"
    argv = ["unsloth-prep", "prepare", str(big), "--tokenizer", str(tiny_model()), "--out", str(out), "--shards", "8",
            "--no-progress"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = build_dir(out) / "_journal.jsonl"
    t0 = time.time()
    while time.time() - t0 < 120 and proc.poll() is None:
        if journal.exists() and journal.read_text().count("\n") >= 2: break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert build_dir(out).exists() and not out.exists()
    # what a writer killed mid-file leaves: its temporary file in the build folder
    (build_dir(out) / f"._part-train-00007.parquet.tmp-{proc.pid}").write_text("what a killed writer leaves")
    s = last_json(run(*argv[1:]))
    assert s["reused_shards"] >= 2 and out.is_dir() and data_files(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"], sorted(p.name for p in tmp_path.iterdir())
    assert not [p.name for p in out.iterdir() if p.name.startswith((".", "_part", "_rejects", "_journal"))]


def test_rerun_cleans_what_a_run_killed_while_publishing_left(tmp_path):
    "A run killed after it moved the earlier output aside (`.x.old-PID`, a dead PID) leaves nothing after a rerun."
    src = tmp_path / "in" / "d.jsonl"
    write_records(src, n=20, seed=2)
    argv = ["prepare", str(src), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "x"), "--no-progress"]
    assert run(*argv).returncode == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = tmp_path / f".x.old-{dead.pid}"
    (tmp_path / "x").rename(old)          # what the killed run left: its earlier output moved aside, half removed
    s = last_json(run(*argv))
    assert s["rows"] > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["in", "x"]


def _session(sid: int) -> list:
    "`(pid, state)` of every process, zombies included, in session `sid`."
    return [(p, fields[0]) for p, fields in _proc_stats() if int(fields[3]) == sid]


@pytest.mark.parametrize("bad", [False, True])
def test_a_run_with_workers_leaves_no_process_once_it_exits(big, tmp_path, bad):
    """Nothing of a `--workers 2` run (workers, multiprocessing's resource tracker) is alive once the command has
    exited, and a bad line with many shards still to take ends the run with exit 2 at once instead of hanging."""
    src = tmp_path / "bad.jsonl" if bad else big
    if bad: src.write_bytes(b'{"messages": [\n' + big.read_bytes())
    argv = ["unsloth-prep", "prepare", str(src), "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "o"),
            "--workers", "2", "--shards", "120", "--no-progress"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try: _, err = proc.communicate(timeout=120)
    finally: proc.kill()
    assert _session(proc.pid) == [], "a process of the run outlived the command"
    assert proc.returncode == (2 if bad else 0), err[-2000:]
    assert ("line 1" in err and "Traceback" not in err) if bad else not (tmp_path / "o" / REJECTS).exists()
