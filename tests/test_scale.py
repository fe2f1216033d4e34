"""unsloth_prep.parallel beyond the notebook: sharded prepare equals the single-process output on JSONL ranges, Parquet
row groups and globs; rejects keep their original file and line; a failing or dying worker fails the run and leaves no
manifest; the Ray Data engine on a real local cluster gives the same rows."""
import json, os, re, sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unsloth_prep.fixtures import tiny_model, write_records
from unsloth_prep.base import MANIFEST, Progress, shard_paths
from unsloth_prep.parallel import _run_local, build_dir, rows_digest, run_prepare_sharded
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


def rejected_lines(manifest):
    """(file name, line) of every reject the manifest lists, in shard order."""
    return [(Path(r["file"]).name, r["line"]) for s in manifest["shards"] for r in s["rejects"]]


def test_workers_equal_single_process_jsonl(corpus):
    d = corpus["d"]
    m = run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], d / "w3", workers=2, shards=3, on_error="skip",
                            max_seq_length=512)
    assert len(m["shards"]) == 3 and m["shards"][1]["source"]["start"] > 0     # really split into byte ranges
    assert rows_digest(shard_paths(d / "w3")) == rows_digest(d / "single_a.parquet")
    assert [m[k] for k in ("rows", "tokens", "rejected")] == [corpus["single"][k] for k in ("rows", "tokens", "rejected")]
    assert rejected_lines(m) == [("a.jsonl", n) for n in corpus["a"]["malformed_lines"]]
    assert m["input"][0]["bytes"] == os.path.getsize(d / "in" / "a.jsonl") and m["settings"]["max_seq_length"] == 512
    kept = [json.loads(line) for line in (d / "w3" / "_part-00001.rejects.jsonl").read_text().splitlines()]
    assert [r["line"] for r in kept] == [r["line"] for r in m["shards"][1]["rejects"]]        # rejects kept on disk


def test_glob_and_parquet_row_groups(corpus):
    d = corpus["d"]
    m = run_prepare_sharded(str(d / "in" / "*.jsonl"), corpus["tok"], d / "glob", workers=2, on_error="skip",
                            max_seq_length=512)
    assert rows_digest(shard_paths(d / "glob" / MANIFEST)) == rows_digest(d / "single_ab.parquet")
    want = [("a.jsonl", n) for n in corpus["a"]["malformed_lines"]] + [("b.jsonl", n) for n in corpus["b"]["malformed_lines"]]
    assert rejected_lines(m) == want
    m = run_prepare_sharded(d / "a.parquet", corpus["tok"], d / "pq", workers=2, shards=3, max_seq_length=512)
    groups = [s["source"]["row_groups"] for s in m["shards"]]
    assert len(groups) == 3 and groups[0][0] == 0 and groups[-1][1] == pq.ParquetFile(d / "a.parquet").num_row_groups
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert rows_digest(shard_paths(d / "pq")) == rows_digest(d / "single_a.parquet")


def test_bad_line_fails_with_original_line_and_keeps_the_previous_output(corpus):
    d = corpus["d"]
    out = d / "fail"
    run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], out, workers=2, on_error="skip")
    before = (sorted(os.listdir(out)), rows_digest(shard_paths(out)))
    with pytest.raises(ValueError) as e:
        run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], out, workers=2)
    msg = str(e.value)
    assert msg.startswith(str(d / "in" / "a.jsonl")) and int(re.search(r"line (\d+)", msg)[1]) in corpus["a"]["malformed_lines"]
    assert (sorted(os.listdir(out)), rows_digest(shard_paths(out))) == before   # nothing new, the old output whole
    assert not build_dir(out).exists()   # bad input: nothing to resume, nothing left


def die(job, q):
    """A worker killed without a word (as the kernel's OOM killer does)."""
    if job["index"] == 1: os._exit(9)
    q.put(("done", job["index"], {"ok": True}))


def test_dead_worker_fails_the_run():
    jobs = [{"index": i, "spec": {"path": f"f{i}"}} for i in range(3)]
    with pytest.raises(RuntimeError, match=r"shard 1 \(f1\) failed: WorkerDied: exit code 9"):
        _run_local(jobs, 2, Progress(enabled=False), target=die)


def test_progress_quiet_off_terminal(capsys):
    with Progress(total_bytes=100, desc="x") as bar: bar.update(5, 50)
    assert capsys.readouterr().err == ""


def test_cli_helper_pack(corpus, tmp_path):
    import argparse
    from unsloth_prep.pipeline import prepare_args, prepare_main
    p = prepare_args(argparse.ArgumentParser())
    args = p.parse_args([str(corpus["d"] / "in" / "a.jsonl"), "--tokenizer", str(corpus["tok"]), "--out",
                         str(tmp_path / "packed.parquet"), "--on-error", "skip", "--workers", "2", "--pack",
                         "--max-seq-length", "512", "--no-progress", "--rejects", str(tmp_path.parent / "r.jsonl")])
    s = prepare_main(args)
    from unsloth_prep.collators import pack_parquet
    ref = pack_parquet(corpus["d"] / "single_a.parquet", tmp_path / "ref.parquet", 512)
    assert s["pack"]["rows"] == ref["rows"] and sorted(os.listdir(tmp_path)) == ["packed.parquet", "ref.parquet"]
    assert pq.read_table(tmp_path / "packed.parquet").equals(pq.read_table(tmp_path / "ref.parquet"))


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
    assert m["engine"] == "ray" and len(m["shards"]) == 3
    assert rows_digest(shard_paths(d / "ray")) == rows_digest(d / "single_a.parquet")
    assert rejected_lines(m) == [("a.jsonl", n) for n in corpus["a"]["malformed_lines"]]
    assert m["rejected"] == corpus["single"]["rejected"] and all(s["worker"]["pid"] != os.getpid() for s in m["shards"])
    with pytest.raises(ValueError, match=r"a\.jsonl: line \d+"):
        run_prepare_sharded(d / "in" / "a.jsonl", corpus["tok"], d / "ray_fail", workers=2, engine="ray", progress=False)
    assert not (d / "ray_fail" / MANIFEST).exists()


def test_ray_convert_equals_one_process(corpus, ray_cluster):
    from unsloth_prep.convert import convert
    from unsloth_prep.parallel import run_convert_sharded
    d = corpus["d"]
    one = convert(d / "in" / "a.jsonl", d / "conv_one.parquet", progress=False)
    m = run_convert_sharded(d / "in" / "a.jsonl", d / "conv_ray", workers=2, shards=3, engine="ray", progress=False)
    assert (m["engine"], m["shards"]) == ("ray", 3)
    assert pq.read_table(shard_paths(d / "conv_ray")).equals(pq.read_table(d / "conv_one.parquet"))
    assert Path(m["rejects"]).read_bytes() == Path(one["rejects"]).read_bytes()
    assert one["first_rejected_lines"] == corpus["a"]["malformed_lines"][:20] == m["first_rejected_lines"]


def test_convert_workers_cli(corpus, tmp_path):
    "`convert --workers 2` from the shell: the report and a shard folder; --strict exits 2 naming file and line."
    import subprocess
    src = corpus["d"] / "in" / "a.jsonl"
    main = "import sys; from unsloth_prep.cli import main; sys.exit(main())"
    run = lambda *a: subprocess.run([sys.executable, "-c", main, "convert", str(src), *map(str, a), "--workers", "2",
                                     "--no-progress"], capture_output=True, text=True, timeout=300)
    p = run(tmp_path / "conv")
    s = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 0 and (s["shards"], s["rejected"]) == (2, corpus["a"]["malformed"])
    assert sorted(os.listdir(tmp_path)) == ["conv", "conv.rejects.jsonl"]
    p = run(tmp_path / "strict", "--strict")
    first = corpus["a"]["malformed_lines"][0]
    assert p.returncode == 2 and f"a.jsonl: line {first}:" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "strict").exists() and sorted(os.listdir(tmp_path)) == ["conv", "conv.rejects.jsonl"]
    p = run(tmp_path / "rpf", "--rows-per-file", "10")
    assert p.returncode == 2 and "--rows-per-file" in p.stderr


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
