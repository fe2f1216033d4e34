"""`unsloth-prep convert` in fresh processes: the line invariant, rejects, strict mode, shards, JSON arrays,
schema drift, atomic output under kill -9, and flat peak memory on larger generated files."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from unsloth_prep.fixtures import write_records
from unsloth_prep.outputs import MANIFEST, REJECTS, build_dir, data_files, hold


def table(out):
    "The converted rows of an output folder, as one table."
    return pq.read_table(data_files(out))


def cli(*args, check=True):
    "Run `unsloth-prep convert ...` in a fresh process; return (returncode, summary dict or None, stdout+stderr)."
    out = subprocess.run(["unsloth-prep", "convert", *map(str, args), "--no-progress"], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if out.returncode == 0 and lines else None
    if check: assert out.returncode == 0, out.stdout + out.stderr
    return out.returncode, summary, out.stdout + out.stderr


def test_invariant_and_rejects(tmp_path):
    info = write_records(tmp_path / "in.jsonl", n=4000, malformed_rate=0.01, blank_rate=0.01, huge_every=1500, seed=5)
    _, s, _ = cli(tmp_path / "in.jsonl", tmp_path / "out", "--block-mb", "0.5")
    assert s["lines"] == s["rows"] + s["rejected"] + s["blank"] == info["lines"]
    assert (s["rows"], s["rejected"], s["blank"]) == (info["records"], info["malformed"], info["blank"])
    assert {"rows", "rejected", "blank", "seconds", "mb_per_s", "peak_rss_mb", "output"} <= set(s)
    rejects = [json.loads(l) for l in open(s["rejects"])]
    assert [r["line"] for r in rejects] == info["malformed_lines"]
    assert all(r["error"] and r["raw"] is not None for r in rejects)
    assert Path(s["rejects"]) == tmp_path / "out" / REJECTS and s["output"] == str(tmp_path / "out")
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in data_files(s["output"])) == info["records"]


def test_strict_names_file_and_line(tmp_path):
    info = write_records(tmp_path / "in.jsonl", n=300, malformed_rate=0.02, seed=6)
    rc, _, text = cli(tmp_path / "in.jsonl", tmp_path / "out", "--strict", check=False)
    assert rc == 2
    assert f"in.jsonl: line {info['malformed_lines'][0]}:" in text
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]       # no build folder left


def test_null_first_line_does_not_crash(tmp_path):
    # pyarrow 26 segfaults on a block that starts with `null`; the converter never hands it such bytes
    p = tmp_path / "in.jsonl"
    p.write_text('null\n{"a": 1}\n{"a": 2}{"a": 3}\n\n{"a": 4}\n')
    _, s, _ = cli(p, tmp_path / "out")
    assert (s["rows"], s["rejected"], s["blank"]) == (2, 2, 1)
    assert table(s["output"])["a"].to_pylist() == [1, 4]


def test_shards_and_existing_output(tmp_path):
    info = write_records(tmp_path / "in.jsonl", n=2500, seed=7)
    _, s, _ = cli(tmp_path / "in.jsonl", tmp_path / "out", "--rows-per-file", "1000", "--compression", "snappy")
    assert [pq.ParquetFile(f).metadata.num_rows for f in s["files"]] == [1000, 1000, 500]
    assert pq.ParquetFile(s["files"][0]).metadata.row_group(0).column(0).compression == "SNAPPY"
    assert s["files"] == [str(f) for f in data_files(tmp_path / "out")]
    mine = tmp_path / "mine"            # an existing folder the tool did not write: refused unless --overwrite
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    rc, _, text = cli(tmp_path / "in.jsonl", mine, check=False)
    assert rc == 2 and "did not write" in text and "--overwrite" in text and (mine / "notes.txt").exists()
    _, s, _ = cli(tmp_path / "in.jsonl", mine, "--overwrite", "--batch-rows", "1000")
    assert not (mine / "notes.txt").exists() and (mine / MANIFEST).exists()
    assert [pq.ParquetFile(f).metadata.num_row_groups for f in data_files(mine)] == [3]
    first = [str(f) for f in data_files(tmp_path / "out")]
    _, again, _ = cli(tmp_path / "in.jsonl", tmp_path / "out", "--rows-per-file", "1000", "--compression", "snappy")
    assert again["up_to_date"] and again["files"] == first and again["rows"] == 2500
    _, s, _ = cli(tmp_path / "in.jsonl", tmp_path / "out", "--batch-rows", "1000")     # its own output: replaced
    assert [pq.ParquetFile(f).metadata.num_row_groups for f in data_files(tmp_path / "out")] == [3]


def test_schema_drift_is_counted_not_nulled(tmp_path):
    p = tmp_path / "in.jsonl"
    rows = [{"id": i, "tags": "a"} for i in range(2000)] + [{"id": f"x{i}", "tags": ["a", "b"], "late": True} for i in range(2000)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, s, _ = cli(p, tmp_path / "out", "--block-mb", "0.02")
    t = table(s["output"])
    assert s["coerced"] == {"id": 2000, "tags": 2000}
    assert t["id"].null_count == 0 and t["tags"].null_count == 0
    assert t["id"].to_pylist()[:2] == ["0", "1"] and t["tags"].to_pylist()[-1] == '["a","b"]'
    assert t["late"].to_pylist()[0] is None and t["late"].to_pylist()[-1] is True


def test_json_array(tmp_path):
    info = write_records(tmp_path / "in.json", n=1500, layout="json_array", pretty=True, huge_every=700, seed=8)
    _, s, _ = cli(tmp_path / "in.json", tmp_path / "out", "--block-mb", "0.3")
    assert (s["format"], s["rows"], s["rejected"]) == ("json_array", info["records"], 0)
    assert table(s["output"]).num_rows == info["records"]
    p = tmp_path / "bad.json"
    p.write_text('[{"a": 1}, {"a": 2},')
    rc, _, text = cli(p, tmp_path / "bad", check=False)
    assert rc == 2 and "not closed" in text and not (tmp_path / "bad").exists() and not build_dir(tmp_path / "bad").exists()


def test_kill_9_leaves_no_output(tmp_path):
    # big enough that a quiet machine is still writing when the first part appears; killed at that moment
    write_records(tmp_path / "in.jsonl", size_mb=150, seed=9)
    out, build = tmp_path / "out", build_dir(tmp_path / "out")
    proc = subprocess.Popen(["unsloth-prep", "convert", str(tmp_path / "in.jsonl"), str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(build.rglob("*.parquet*")):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL); proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the converter finished before it could be killed"
    assert not out.exists() and list(build.rglob("*.parquet*"))          # what the killed run left: its build
    assert sorted(p.name for p in tmp_path.iterdir()) == [build.name, "in.jsonl"]
    small = write_records(tmp_path / "small.jsonl", n=50, seed=9)
    with hold(build, out):                                                # a live run holds the output: refused,
        rc, _, text = cli(small["path"], out, check=False)                # and its build is left alone
        assert rc == 2 and "another unsloth-prep run is writing" in text and list(build.rglob("*.parquet*"))
    _, s, _ = cli(small["path"], out)
    assert s["rows"] == 50 and table(out).num_rows == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out", "small.jsonl"]   # the dead build is gone


def test_line_by_line_path_numbers_lines_exactly(tmp_path):
    "Lines pyarrow refuses (`tru`, bad escapes) or reads leniently (`NaN`) are rejected at their own line number."
    bad = {7: b'{"a": tru, "x": 1.5}', 130: b'{"a": "\\x", "x": 1.5}', 131: b'{"a": NaN, "x": 1.5}',
           402: b'{"a": 1, "x": -Infinity}', 999: b'{"a": "\\ud800", "x": 1.5}'}
    lines = [bad.get(i, json.dumps({"a": i, "x": i / 2}).encode()) for i in range(1, 1001)]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    _, s, _ = cli(tmp_path / "in.jsonl", tmp_path / "out", "--block-mb", "0.005")
    rejects = [json.loads(l) for l in open(s["rejects"])]
    assert [r["line"] for r in rejects] == sorted(bad)
    assert [r["raw"].encode() for r in rejects] == [bad[n] for n in sorted(bad)]
    assert s["slow_blocks"] == 0 and s["rows"] == 995      # each bad line is picked out; no block goes line by line
    assert table(s["output"])["a"].to_pylist() == [i for i in range(1, 1001) if i not in bad]


def _peak(src, dst):
    "Peak RSS (MB) of one CLI conversion."
    _, s, _ = cli(src, dst)
    return s["peak_rss_mb"], s


@pytest.mark.parametrize("layout", ["jsonl", "json_array"])
def test_peak_rss_flat_in_input_size(tmp_path, layout):
    ext = "jsonl" if layout == "jsonl" else "json"
    small = write_records(tmp_path / f"s.{ext}", size_mb=16, layout=layout, huge_every=5000, seed=10)
    big = write_records(tmp_path / f"b.{ext}", size_mb=64, layout=layout, huge_every=5000, seed=10)
    p_small, _ = _peak(tmp_path / f"s.{ext}", tmp_path / "s")
    p_big, s = _peak(tmp_path / f"b.{ext}", tmp_path / "b")
    assert s["rows"] == big["records"]
    assert p_big < 256, p_big
    assert p_big <= 1.25 * p_small, (p_small, p_big)
