"""Outputs where the data lives: `--out`, `--rejects` and a config's `data.path` as URLs, against a real S3 server
(moto's server mode on 127.0.0.1, tests/s3server.py). One process, `--workers 2` and Ray actors write their shards by
URL and give the local run's rows; the ownership rules, the up-to-date check and resume hold there; a lock object with
a heartbeat keeps one run at a time; a run killed while publishing leaves an output every reader refuses, and the next
run completes it."""
import json, subprocess, sys, threading, time

import pytest

pytest.importorskip("moto.server", reason="the S3 server tests need moto[server] (dev requirements)")
pytest.importorskip("s3fs", reason="the S3 server tests need s3fs (dev requirements)")

from clitools import last_json, read_rows, run
from s3server import BUCKET
from unsloth_prep.base import MANIFEST
from unsloth_prep.fixtures import tiny_model
from unsloth_prep import outputs
from unsloth_prep.outputs import (GUARD, LOCK, README, REJECTS, StoreLock, build_dir, exists, join, listing,
                                  read_bytes, write_bytes)

SRC = f"s3://{BUCKET}/chat.jsonl"
ARGS = ["--max-seq-length", "256", "--on-error", "skip", "--no-progress"]
# a command line run with a hook: `python -c HOOK prepare ...` (the hook's code first, then the CLI)
HOOK = "import os, signal, sys, threading\nfrom unsloth_prep import outputs, parallel\n{hook}\n" \
       "from unsloth_prep.cli import main\nsys.exit(main(sys.argv[1:]))"
# kill -9 once the publishing run has copied two of its files to their final names
KILL_IN_PUBLISH = """
copied, lock, copy, publish = [0], threading.Lock(), outputs.copy_file, outputs._publish_store
def copy_then_die(src, dst):
    copy(src, dst)
    with lock:
        copied[0] += 1
        if copied[0] == 2: os.kill(os.getpid(), signal.SIGKILL)
def publishing(build, out):
    outputs.copy_file = copy_then_die
    return publish(build, out)
outputs._publish_store = publishing"""
# kill -9 as soon as the journal holds one completed shard
KILL_AFTER_A_SHARD = """
record = parallel.Journal.record
def record_then_die(self, job, summary):
    record(self, job, summary)
    os.kill(os.getpid(), signal.SIGKILL)
parallel.Journal.record = record_then_die"""


def prepare(data, out, *extra, check=True, hook=None):
    "`unsloth-prep prepare DATA --out OUT` in a fresh process (the environment holds the server's endpoint)."
    head = [sys.executable, "-c", HOOK.format(hook=hook)] if hook else ["unsloth-prep"]
    r = run(*head, "prepare", data, "--tokenizer", tiny_model(), "--out", out, *ARGS, *extra, check=False)
    if check: assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def local(s3, tmp_path_factory):
    "The rows (and summary) of the run that reads and writes local files: what every other run must give."
    s = last_json(prepare(s3 / "chat.jsonl", tmp_path_factory.mktemp("local") / "out"))
    return read_rows(s["out"]), s


def manifest(out: str) -> dict:
    return json.loads(read_bytes(join(out, MANIFEST)))


def published(out: str, rejects: bool = True) -> list:
    "What a complete output in the store holds."
    files = [f["path"] for sp in manifest(out)["splits"].values() for f in sp["files"]]
    return sorted([MANIFEST, README, *files, *([REJECTS] if rejects else [])])


def test_one_process_and_workers_write_the_local_rows_to_s3(s3, local):
    rows, ref = local
    one = last_json(prepare(SRC, f"s3://{BUCKET}/out/one"))
    two = last_json(prepare(SRC, f"s3://{BUCKET}/out/two", "--workers", "2"))
    for s in (one, two):
        assert s["out"].startswith("s3://") and read_rows(s["out"]) == rows and s["rejected"] == ref["rejected"] > 0
        assert sorted(listing(s["out"])) == published(s["out"])
        assert not exists(build_dir(s["out"]))                      # the build prefix went once published
        lines = read_bytes(join(s["out"], REJECTS)).decode().splitlines()
        assert [json.loads(x)["line"] for x in lines] == ref["first_rejected_lines"]
    assert two["shards"] == 2 and len(two["files"]) == 2
    again = last_json(prepare(SRC, f"s3://{BUCKET}/out/two", "--workers", "2"))
    assert again["up_to_date"] and again["rows"] == two["rows"]      # same content: nothing was redone


def test_ray_actors_read_and_write_by_url(s3, local):
    "`--engine ray --workers 2` on a real local Ray cluster: the actors read their byte ranges and write their shards."
    out = f"s3://{BUCKET}/out/ray"
    argv = ["unsloth-prep", "prepare", SRC, "--tokenizer", str(tiny_model()), "--out", out, *ARGS,
            "--engine", "ray", "--workers", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    s = json.loads(stdout.strip().splitlines()[-1])
    assert s["engine"] == "ray" and s["shards"] == 2 and read_rows(out) == local[0]
    m = manifest(out)
    assert {p["path"] for sh in m["shards"] for p in sh["source"]} == {SRC}   # each job names the object, not rows
    assert {sh["worker"]["pid"] for sh in m["shards"]}.isdisjoint({proc.pid})  # rows made and written in the actors
    assert sorted(listing(out)) == published(out)


def test_what_a_run_may_write_over_in_a_store(s3, local, tmp_path):
    mine = f"s3://{BUCKET}/mine"
    write_bytes(f"{mine}/notes.txt", b"my notes")
    r = prepare(SRC, mine, check=False)
    assert r.returncode == 2 and "did not write" in r.stderr and mine in r.stderr and "Traceback" not in r.stderr
    assert read_bytes(f"{mine}/notes.txt") == b"my notes"
    for out in (SRC, f"s3://{BUCKET}", f"s3://{BUCKET}/data"):      # the input, a whole bucket, a prefix of inputs
        data = f"s3://{BUCKET}/data/*.jsonl" if out.endswith("/data") else SRC
        r = prepare(data, out, "--overwrite", check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = prepare(SRC, f"s3://{BUCKET}/out/r", "--rejects", f"s3://{BUCKET}/out/r/bad.jsonl", check=False)
    assert r.returncode == 2 and "inside --out" in r.stderr
    s = last_json(prepare(SRC, mine, "--overwrite", "--rejects", f"s3://{BUCKET}/rejected/chat.jsonl"))
    assert read_rows(mine) == local[0] and not exists(f"{mine}/notes.txt") and REJECTS not in listing(mine)
    assert s["rejects"] == f"s3://{BUCKET}/rejected/chat.jsonl"
    assert len(read_bytes(s["rejects"]).splitlines()) == local[1]["rejected"]
    again = last_json(prepare(SRC, mine, "--rejects", f"s3://{BUCKET}/rejected/chat.jsonl"))
    assert again["up_to_date"]                                                     # its own rejects file: allowed
    write_bytes(f"s3://{BUCKET}/theirs.jsonl", b"{}\n")
    r = prepare(SRC, f"s3://{BUCKET}/out/r", "--rejects", f"s3://{BUCKET}/theirs.jsonl", check=False)
    assert r.returncode == 2 and "did not write" in r.stderr and read_bytes(f"s3://{BUCKET}/theirs.jsonl") == b"{}\n"
    r = prepare(SRC, "s3://no-such-bucket-out/run", check=False)
    assert r.returncode == 2 and "s3://no-such-bucket-out/run" in r.stderr and "Traceback" not in r.stderr
    f = last_json(prepare(SRC, f"file://{tmp_path}/via-file"))                     # file:// is a local path
    assert f["out"] == str(tmp_path / "via-file") and read_rows(f["out"]) == local[0]


def test_a_config_whose_data_path_is_a_url(s3, local, tmp_path):
    import yaml
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": str(tiny_model())}, "max_seq_length": 256, "data": {
        "path": f"s3://{BUCKET}/out/cfg", "source": SRC}}))
    s = last_json(run("unsloth-prep", "prepare", "--config", cfg, "--on-error", "skip", "--no-progress"))
    assert s["out"] == f"s3://{BUCKET}/out/cfg" and read_rows(s["out"]) == local[0]
    from unsloth_prep.training import _files
    assert _files(s["out"]) == s["files"]                       # what `train` reads for data.path


def test_one_run_at_a_time_on_a_store(s3, local):
    out = f"s3://{BUCKET}/out/locked"
    lock_at = join(build_dir(out), LOCK)
    with outputs.hold(build_dir(out), out):                     # a live run on this output
        r = prepare(SRC, out, check=False)
        assert r.returncode == 2 and "another unsloth-prep run is writing this output" in r.stderr
        assert str(__import__("os").getpid()) in r.stderr
    assert not exists(lock_at)
    elsewhere = {"tool": "unsloth_prep", "run": "x", "host": "node-7/boot", "pid": 4242}
    write_bytes(lock_at, json.dumps({**elsewhere, "beat": time.time()}).encode())
    r = prepare(SRC, out, check=False)                          # a run on another machine, beating: refused
    assert r.returncode == 2 and "process 4242 on node-7" in r.stderr
    write_bytes(lock_at, json.dumps({**elsewhere, "beat": time.time() - outputs.STALE_S - 5}).encode())
    s = last_json(prepare(SRC, out))                            # no heartbeat for STALE_S: taken over
    assert read_rows(s["out"]) == local[0] and not exists(build_dir(out))


def within(seconds: float, cond) -> bool:
    "Whether `cond()` holds within `seconds` (a loaded machine may take longer than a few heartbeats)."
    deadline = time.time() + seconds
    while not cond():
        if time.time() > deadline: return False
        time.sleep(0.05)
    return True


def test_a_stale_lock_has_one_taker_and_a_lost_lock_is_noticed(s3, monkeypatch):
    folder = f"s3://{BUCKET}/.race.build"
    for _ in range(3):
        write_bytes(join(folder, LOCK), json.dumps({"host": "gone/1", "pid": 1, "beat": 0}).encode())
        got, go = [], threading.Barrier(2)
        def take():
            go.wait()
            try: got.append(StoreLock(folder, "race").acquire())
            except ValueError as e: got.append(e)
        threads = [threading.Thread(target=take) for _ in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        won = [g for g in got if isinstance(g, StoreLock)]
        assert len(won) == 1 and "another unsloth-prep run" in str(next(g for g in got if isinstance(g, ValueError)))
        won[0].release()
    monkeypatch.setattr(outputs, "HEARTBEAT_S", 0.1)
    lock = StoreLock(folder, "race").acquire()
    beat = json.loads(read_bytes(lock.path))["beat"]
    beaten = lambda: json.loads(read_bytes(lock.path))["beat"] > beat
    assert within(10, beaten)                                      # the holder refreshes its heartbeat
    write_bytes(lock.path, json.dumps({"run": "other", "host": "node-9/b", "pid": 9, "beat": time.time()}).encode())
    assert within(10, lambda: lock.lost)
    assert "node-9" in lock.lost
    with pytest.raises(ValueError, match="lost its lock"): lock.check()
    lock.release()
    assert json.loads(read_bytes(lock.path))["run"] == "other"     # the new holder's lock stays


def test_a_takeover_between_the_heartbeat_read_and_write_keeps_the_lock(s3, monkeypatch):
    "Another run writes the lock just after the heartbeat read it as this run's: the takeover stands and is seen."
    monkeypatch.setattr(outputs, "HEARTBEAT_S", 0.05)
    lock = StoreLock(f"s3://{BUCKET}/.race2.build", "race").acquire()
    read, taken = lock.holder, []
    def read_then_taken():
        seen = read()
        if seen.get("run") == lock.run and not taken:        # the heartbeat has read its own lock: the other run writes
            other = {"run": "other", "host": "node-7/x", "pid": 7, "beat": time.time()}
            write_bytes(lock.path, json.dumps(other).encode())
            taken.append(time.time())
        return seen
    lock.holder = read_then_taken
    within(10, lambda: lock.lost)
    lock.holder = read
    assert taken and lock.lost and "node-7" in lock.lost
    assert json.loads(read_bytes(lock.path))["run"] == "other"     # the heartbeat did not write over it
    lock.release()
    assert json.loads(read_bytes(lock.path))["run"] == "other"


def _refused_by_every_reader(out: str, tmp_path):
    "`train`'s reader, `load_prepared` and `load_dataset` (on a copy of the prefix) refuse `out` as incomplete."
    import s3fs
    from datasets import load_dataset
    import unsloth_prep
    from unsloth_prep.training import _files
    for read in (_files, unsloth_prep.load_prepared):
        with pytest.raises(ValueError, match="incomplete"): read(out)
    mirror = tmp_path / "mirror"
    s3fs.S3FileSystem().get(out.split("://")[1] + "/", str(mirror), recursive=True)
    with pytest.raises(FileNotFoundError, match=GUARD): load_dataset(str(mirror))


def test_kill_9_while_publishing_leaves_an_incomplete_output_that_the_next_run_completes(s3, local, tmp_path):
    out = f"s3://{BUCKET}/out/killed"
    first = last_json(prepare(SRC, out, "--shards", "3", "--eval-size", "20"))    # an earlier complete output
    r = prepare(SRC, out, "--workers", "2", hook=KILL_IN_PUBLISH, check=False)
    assert r.returncode == -9, r.stderr[-2000:]
    left = listing(out)
    assert MANIFEST not in left and GUARD.encode() in read_bytes(join(out, README)) and exists(build_dir(out))
    assert any(n.endswith("-of-00002.parquet") for n in left)                    # some files were copied
    assert not any(n.endswith("-of-00003.parquet") for n in left)                # the earlier output's went first
    _refused_by_every_reader(out, tmp_path)
    s = last_json(prepare(SRC, out, "--workers", "2"))
    assert read_rows(out) == local[0] and s["reused_shards"] == s["shards"] == 2 and not s["up_to_date"]
    assert sorted(listing(out)) == published(out)
    assert "validation" in first["splits"] and "validation" not in s["splits"]
    from datasets import load_dataset
    import s3fs
    s3fs.S3FileSystem().get(out.split("://")[1] + "/", str(tmp_path / "done"), recursive=True)
    assert load_dataset(str(tmp_path / "done"))["train"].num_rows == len(local[0])
    import unsloth_prep
    assert unsloth_prep.load_prepared(out).num_rows == len(local[0])


def test_kill_9_after_a_shard_resumes_from_the_build_prefix(s3, local):
    out = f"s3://{BUCKET}/out/resumed"
    r = prepare(SRC, out, "--shards", "3", hook=KILL_AFTER_A_SHARD, check=False)
    assert r.returncode == -9, r.stderr[-2000:]
    build = build_dir(out)
    assert not exists(out) and len(listing(join(build, "_journal"))) == 1 and LOCK in listing(build)
    s = last_json(prepare(SRC, out, "--shards", "3"))          # its lock's process is gone: taken over at once
    assert s["reused_shards"] == 1 and s["shards"] == 3 and read_rows(out) == local[0]
