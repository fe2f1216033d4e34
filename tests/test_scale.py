"""unsloth_prep.parallel beyond the notebook: sharded prepare (`pipeline.run_prepare`, what the CLI runs) equals the
single-process output on JSONL ranges, Parquet row groups and globs; rejects keep their original file and line; a
failing or dying worker fails the run and leaves no manifest; the Ray Data engine on a real local cluster gives the
same rows."""
import json, os, re, sys, time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unsloth_prep.fixtures import tiny_model, write_records
from unsloth_prep.base import MANIFEST, Progress
from unsloth_prep.outputs import REJECTS, build_dir, data_files, read_manifest
from unsloth_prep.parallel import _run_local, plan_work, rows_digest
from unsloth_prep.pipeline import parse_request, run_prepare
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep.tokenization import prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL files with malformed lines, their single-process prepare output, and a Parquet copy of the records."""
    d = tmp_path_factory.mktemp("scale")
    a = write_records(d / "in" / "a.jsonl", n=300, fmt="openai", malformed_rate=0.02, seed=3)
    b = write_records(d / "in" / "b.jsonl", n=120, fmt="openai", malformed_rate=0.03, seed=4)
    tok_path = tiny_model()
    tok = load_tokenizer(tok_path)
    single = prepare(d / "in" / "a.jsonl", tok, d / "single_a.parquet", on_error="skip", max_seq_length=512)
    both = prepare(str(d / "in" / "*.jsonl"), tok, d / "single_ab.parquet", on_error="skip", max_seq_length=512)
    good = [json.loads(line) for line in (d / "in" / "a.jsonl").read_text().splitlines() if _is_record(line)]
    pq.write_table(pa.Table.from_pylist(good), d / "a.parquet", row_group_size=40)
    return dict(d=d, a=a, b=b, tok=tok_path, single=single, both=both)


def _is_record(line):
    """True for a line that parses as a JSON object."""
    try: return isinstance(json.loads(line), dict)
    except ValueError: return False


def run_prepare_sharded(data, tokenizer, out, **options) -> dict:
    """`prepare` through the pipeline (what the CLI runs): the summary, with the output's manifest under "manifest"."""
    given = {"data": str(data), "tokenizer": str(tokenizer), "out": str(out), "progress": False, **options}
    s = run_prepare(*parse_request(given, "python"))
    return {**s, "manifest": read_manifest(out)}


def rejected_lines(manifest):
    """(file name, line) of every reject the manifest lists, in shard order."""
    return [(Path(r["file"]).name, r["line"]) for s in manifest["shards"] for r in s["rejects"]]


def test_workers_equal_single_process_jsonl(corpus):
    d = corpus["d"]
    plan = plan_work([str(d / "in" / "a.jsonl")], 3)
    assert len(plan) == 3 and plan[1]["parts"][0]["start"] > 0                   # really split into byte ranges
    m = run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], d / "w3", workers=2, shards=3, on_error="skip",
                            max_seq_length=512)
    assert m["shards"] == 3 and len(m["manifest"]["shards"]) == 3 and len(data_files(d / "w3")) == 3
    assert rows_digest(data_files(d / "w3")) == rows_digest(d / "single_a.parquet")
    assert [m[k] for k in ("rows", "tokens", "rejected")] == [corpus["single"][k] for k in ("rows", "tokens", "rejected")]
    assert rejected_lines(m["manifest"]) == [("a.jsonl", n) for n in corpus["a"]["malformed_lines"]]
    assert m["manifest"]["settings"]["max_seq_length"] == 512
    assert m["rejects"] == str(d / "w3" / REJECTS)
    kept = [json.loads(line) for line in Path(m["rejects"]).read_text().splitlines()]    # rejects kept on disk,
    assert [(Path(r["file"]).name, r["line"]) for r in kept] == rejected_lines(m["manifest"])   # in input order


def test_glob_and_parquet_row_groups(corpus):
    d = corpus["d"]
    m = run_prepare_sharded(str(d / "in" / "*.jsonl"), corpus["tok"], d / "glob", workers=2, on_error="skip",
                            max_seq_length=512)
    assert rows_digest(data_files(d / "glob")) == rows_digest(d / "single_ab.parquet")
    want = [("a.jsonl", n) for n in corpus["a"]["malformed_lines"]] + [("b.jsonl", n) for n in corpus["b"]["malformed_lines"]]
    assert rejected_lines(m["manifest"]) == want
    plan = plan_work([str(d / "a.parquet")], 3)
    groups = [p["row_groups"] for s in plan for p in s["parts"]]
    assert len(groups) == 3 and groups[0][0] == 0 and groups[-1][1] == pq.ParquetFile(d / "a.parquet").num_row_groups
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    m = run_prepare_sharded(d / "a.parquet", corpus["tok"], d / "pq", workers=2, shards=3, max_seq_length=512)
    assert m["shards"] == 3 and len(data_files(d / "pq")) == 3
    assert rows_digest(data_files(d / "pq")) == rows_digest(d / "single_a.parquet")


def test_bad_line_fails_with_original_line_and_keeps_the_previous_output(corpus):
    d = corpus["d"]
    out = d / "fail"
    run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], out, workers=2, on_error="skip")
    before = (sorted(os.listdir(out)), rows_digest(data_files(out)))
    with pytest.raises(ValueError) as e:
        run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], out, workers=2)
    msg = str(e.value)
    assert msg.startswith(str(d / "in" / "a.jsonl")) and int(re.search(r"line (\d+)", msg)[1]) in corpus["a"]["malformed_lines"]
    assert (sorted(os.listdir(out)), rows_digest(data_files(out))) == before   # nothing new, the old output whole
    assert not build_dir(out).exists()   # bad input: nothing to resume, nothing left


DIE = """import os, sys, time
from unsloth_prep.base import Progress
from unsloth_prep.parallel import _run_local
from unsloth_prep.steps import Step, make_options

class DieStep(Step):
    "A step whose worker on shard 1 is killed without a word (as the kernel's OOM killer does)."
    name = "die"
    def __init__(self, delay): self.delay = delay
    def run(self, job, state, report=None):
        if job["index"] == 1:
            if self.delay: time.sleep(self.delay)
            os._exit(9)
        return {"records": 0, "files": []}

if __name__ == "__main__":
    jobs = [{"index": i, "step": DieStep(float(sys.argv[1])), "opts": make_options({}), "split": "train",
             "key": str(i), "spec": {"parts": [{"path": f"f{i}"}], "bytes": 0}, "out": f"{i}.parquet",
             "rejects": f"{i}.jsonl"} for i in range(3)]
    try: _run_local(jobs, 2, Progress(enabled=False))
    except RuntimeError as e: sys.exit(str(e))
"""


def _dead_worker_run(tmp_path, delay: float):
    "Three jobs in two workers, the worker of job 1 killed `delay` seconds into it; what the parent raised."
    import subprocess
    (tmp_path / "die.py").write_text(DIE)
    try:
        return subprocess.run([sys.executable, "die.py", str(delay)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60).stderr
    except subprocess.TimeoutExpired: return "the run still waits after 60 s"


def test_dead_worker_fails_the_run(tmp_path):
    "A worker killed in the middle of a shard fails the run, naming the shard."
    assert "shard 1 (f1) failed: WorkerDied: exit code 9" in _dead_worker_run(tmp_path, 1.0)


def test_worker_killed_at_once_fails_the_run(tmp_path):
    "A worker killed the moment it takes a shard fails the run too (no hang)."
    assert "shard 1 (f1) failed: WorkerDied: exit code 9" in _dead_worker_run(tmp_path, 0.0)


STARTUP = """import sys
from unsloth_prep.base import Progress
from unsloth_prep.parallel import _run_local
from unsloth_prep.steps import Step, make_options

def _refuse(): raise RuntimeError("this step cannot be loaded in a worker")

class Unloadable(Step):
    "A step that pickles in the parent and fails to load in every worker, before the worker takes its job."
    name = "unloadable"
    def __reduce__(self): return (_refuse, ())

if __name__ == "__main__":
    jobs = [{"index": i, "step": Unloadable(), "opts": make_options({}), "split": "train", "key": str(i),
             "spec": {"parts": [{"path": f"f{i}"}], "bytes": 0}, "out": f"{i}.parquet", "rejects": f"{i}.jsonl"}
            for i in range(3)]
    try: _run_local(jobs, 2, Progress(enabled=False))
    except RuntimeError as e: sys.exit(str(e).splitlines()[0])
"""


def test_workers_dead_before_any_job_fail_the_run(tmp_path):
    "Every worker dying as it starts (before it holds a job) fails the run naming the first shard: no endless wait."
    import subprocess
    (tmp_path / "startup.py").write_text(STARTUP)
    try: err = subprocess.run([sys.executable, "startup.py"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60).stderr
    except subprocess.TimeoutExpired: err = "the run still waits after 60 s"
    assert "this step cannot be loaded in a worker" in err     # each worker's own traceback reaches stderr
    assert err.strip().splitlines()[-1] == ("shard 0 (f0) failed: WorkerDied: every worker ended before it was done "
                                            "(exit codes 1, 1)")


def test_notebook_run_of_a_step_class_still_runs_on_workers(corpus, tmp_path):
    """A notebook that runs a step's class again (its class is then in `__main__`, which a worker cannot import)
    keeps the registered class, so `--workers 2` runs in that kernel as it does from the shell."""
    from unsloth_prep.steps import STEPS, register
    from unsloth_prep.tokenization import ChatStep
    original = STEPS["sft"]
    again = type("ChatStep", (ChatStep,), {"__module__": "__main__"})   # what `class ChatStep` in a notebook makes
    try:
        assert register(again()) is original and STEPS["sft"] is original
        m = run_prepare_sharded(corpus["d"] / "in" / "a.jsonl", corpus["tok"], tmp_path / "w", workers=2, shards=2,
                                on_error="skip", max_seq_length=512)
        assert rows_digest(data_files(tmp_path / "w")) == rows_digest(corpus["d"] / "single_a.parquet")
    finally: STEPS["sft"] = original


def test_a_job_a_worker_cannot_load_fails_at_once(tmp_path, monkeypatch):
    "A step defined only in `__main__` cannot reach a worker: a ValueError before any starts, not a lost job."
    from unsloth_prep.steps import Step, make_options
    only_here = type("OnlyHere", (Step,), {"__module__": "__main__", "name": "only-here"})
    jobs = [{"index": i, "step": only_here(), "opts": make_options({}), "split": "train", "key": str(i),
             "spec": {"parts": [{"path": f"f{i}"}], "bytes": 0}, "out": str(tmp_path / f"{i}.parquet"),
             "rejects": str(tmp_path / f"{i}.jsonl")} for i in range(2)]
    import types                                        # a script's __main__: a file, but without the class
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "script.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    with pytest.raises(ValueError, match="cannot be sent to a worker process .*; define it in a module, or run with"):
        _run_local(jobs, 2, Progress(enabled=False))
    # a notebook's __main__ has no file a worker could import
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    with pytest.raises(ValueError, match="'OnlyHere' is defined in this notebook .*; define it in a module"):
        _run_local(jobs, 2, Progress(enabled=False))


def test_progress_quiet_off_terminal(capsys):
    with Progress(total_bytes=100, desc="x") as bar: bar.update(5, 50)
    assert capsys.readouterr().err == ""


def test_cli_helper_pack(corpus, tmp_path):
    import argparse
    from unsloth_prep.pipeline import prepare_args, prepare_main
    p = prepare_args(argparse.ArgumentParser())
    args = p.parse_args([str(corpus["d"] / "in" / "a.jsonl"), "--tokenizer", str(corpus["tok"]), "--out",
                         str(tmp_path / "packed"), "--on-error", "skip", "--workers", "2", "--pack",
                         "--max-seq-length", "512", "--no-progress", "--rejects", str(tmp_path.parent / "r.jsonl")])
    s = prepare_main(args)
    from unsloth_prep.collators import pack_parquet
    ref = pack_parquet(corpus["d"] / "single_a.parquet", tmp_path / "ref.parquet", 512)
    assert s["pack"]["rows"] == ref["rows"] and sorted(os.listdir(tmp_path)) == ["packed", "ref.parquet"]
    assert s["rows"] == ref["rows"] and (tmp_path.parent / "r.jsonl").exists()
    assert pq.read_table(data_files(tmp_path / "packed")).equals(pq.read_table(tmp_path / "ref.parquet"))


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for the module; started here, shut down after."""
    ray = pytest.importorskip("ray")
    if not os.environ.get("RAY_ADDRESS") and not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    yield ray
    ray.shutdown()


def test_ray_engine_equals_single_process(corpus, ray_cluster):
    d = corpus["d"]
    m = run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], d / "ray", workers=2, shards=3, on_error="skip",
                            max_seq_length=512, engine="ray", progress=False)
    assert m["engine"] == "ray" and m["shards"] == len(m["manifest"]["shards"]) == 3
    assert rows_digest(data_files(d / "ray")) == rows_digest(d / "single_a.parquet")
    assert rejected_lines(m["manifest"]) == [("a.jsonl", n) for n in corpus["a"]["malformed_lines"]]
    assert m["rejected"] == corpus["single"]["rejected"]
    assert all(s["worker"]["pid"] != os.getpid() for s in m["manifest"]["shards"])
    with pytest.raises(ValueError, match=r"a\.jsonl: line \d+"):
        run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], d / "ray_fail", workers=2, engine="ray", progress=False)
    assert not (d / "ray_fail" / MANIFEST).exists() and not build_dir(d / "ray_fail").exists()


def test_ray_failure_stops_the_other_actors_before_it_is_raised(corpus, ray_cluster, tmp_path):
    """A shard that fails at its first line while another actor is far from done with its own: the bad line is raised,
    and nothing writes into the removed build afterwards (Ray Data lets a running call finish: the actor must stop)."""
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    turn = lambda i: json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                              {"role": "assistant", "content": f"answer {i}"}]})
    (d / "a_bad.jsonl").write_text("{not json\n" + "\n".join(turn(i) for i in range(100)) + "\n")
    (d / "b_long.jsonl").write_text("\n".join(turn(i) for i in range(150_000)) + "\n")
    with pytest.raises(ValueError, match=r"a_bad\.jsonl: line 1\b"):
        run_prepare_sharded(d / "*.jsonl", corpus["tok"], out, workers=2, shards=2, engine="ray", progress=False)
    time.sleep(4)      # longer than the other shard's remaining work took before actors stopped
    assert not out.exists() and not build_dir(out).exists()


def test_ray_convert_equals_one_process(corpus, ray_cluster):
    import argparse
    from unsloth_prep.convert import convert
    from unsloth_prep.pipeline import convert_args, convert_main
    d = corpus["d"]
    one = convert(d / "in" / "a.jsonl", d / "conv_one.parquet", progress=False)
    parser = argparse.ArgumentParser()
    convert_args(parser)
    args = parser.parse_args(
        [str(d / "in" / "a.jsonl"), "--out", str(d / "conv_ray"), "--workers", "2", "--shards", "3", "--engine", "ray",
         "--no-progress"])
    m = convert_main(args)
    assert (m["engine"], m["shards"]) == ("ray", 3) and len(data_files(d / "conv_ray")) == 3
    assert pq.read_table(data_files(d / "conv_ray")).equals(pq.read_table(d / "conv_one.parquet"))
    assert m["rejects"] == str(d / "conv_ray" / REJECTS)
    assert Path(m["rejects"]).read_bytes() == Path(one["rejects"]).read_bytes()
    assert one["first_rejected_lines"] == corpus["a"]["malformed_lines"][:20] == m["first_rejected_lines"]


def test_convert_workers_cli(corpus, tmp_path):
    "`convert --workers 2` from the shell: the report and an output folder; --strict exits 2 naming file and line."
    import subprocess
    src = corpus["d"] / "in" / "a.jsonl"
    main = "import sys; from unsloth_prep.cli import main; sys.exit(main())"
    run = lambda *a: subprocess.run([sys.executable, "-c", main, "convert", str(src), *map(str, a), "--workers", "2",
                                     "--no-progress"], capture_output=True, text=True, timeout=300)
    p = run(tmp_path / "conv")
    s = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 0 and (s["shards"], s["rejected"]) == (2, corpus["a"]["malformed"])
    assert sorted(os.listdir(tmp_path)) == ["conv"] and len(data_files(tmp_path / "conv")) == 2
    assert len((tmp_path / "conv" / REJECTS).read_text().splitlines()) == corpus["a"]["malformed"]
    p = run(tmp_path / "strict", "--strict")
    first = corpus["a"]["malformed_lines"][0]
    assert p.returncode == 2 and f"a.jsonl: line {first}:" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "strict").exists() and sorted(os.listdir(tmp_path)) == ["conv"]
    p = run(tmp_path / "rpf", "--rows-per-file", "10")    # honoured with workers: no file over 10 rows, no row lost
    rows = [pq.ParquetFile(f).metadata.num_rows for f in data_files(tmp_path / "rpf")]
    assert p.returncode == 0 and max(rows) <= 10 and sum(rows) == s["rows"] == json.loads(p.stdout.splitlines()[-1])["rows"]
    assert pq.read_table(data_files(tmp_path / "rpf")).equals(pq.read_table(data_files(tmp_path / "conv")))


def test_prepare_and_stats_progress_count_megabytes(corpus, tmp_path, capsys):
    "On a terminal, prepare's and stats' bars show the MB read against the input's size, ending at 100%."
    from unsloth_prep.tokenization import collect_stats
    src = corpus["d"] / "in" / "a.jsonl"
    size = f"/{os.path.getsize(src) / 2**20:,.1f} MB (100%)"
    prepare(src, load_tokenizer(corpus["tok"]), tmp_path / "p.parquet", on_error="skip", progress=True)
    last = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert last.startswith(f"prepare: {corpus['a']['records']:,} rows, ") and size in last, last
    collect_stats(src, load_tokenizer(corpus["tok"]), on_error="skip", progress=True)
    last = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert last.startswith("stats: ") and size in last, last
