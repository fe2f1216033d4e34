"""`inspect`, `convert` and `doctor` agree on the same bytes: over a corpus of bad inputs (one file per class), each
command, run in a fresh process, accepts the same rows and rejects the same line numbers with the same reasons,
and those are the ones the corpus was written to have."""
import gzip, json, subprocess, sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from unsloth_prep.loading import Rejects, iter_file
from unsloth_prep.outputs import REJECTS, data_files

WIDE = 123456789012345678901234567890
DEEP = b"[" * 5000 + b"]" * 5000


def good(i, **extra):
    "One valid Alpaca record as (JSON bytes, the record)."
    rec = {"instruction": f"q{i}", "output": f"a{i}", "score": i + 0.5, **extra}
    return json.dumps(rec, ensure_ascii=False).encode(), rec


def line(i, **extra): return good(i, **extra)[0]
def rec(i, **extra): return good(i, **extra)[1]


# name -> (file name, bytes, accepted records in order, {bad line/element number: words its reason contains})
CASES = {
    "bom_line_1": ("bom.jsonl", b"\xef\xbb\xbf" + line(1) + b"\n" + line(2) + b"\n", [rec(1), rec(2)], {}),
    "latin1_byte": ("latin1.jsonl", line(1) + b'\n{"instruction": "caf\xe9", "output": "x", "score": 1.5}\n' + line(3) + b"\n",
                    [rec(1), rec(3)], {2: "not valid UTF-8"}),
    "deep_5000": ("deep.jsonl", line(1) + b'\n{"instruction": "q", "output": "a", "score": 0.5, "x": ' + DEEP + b"}\n"
                  + line(3) + b"\n", [rec(1), rec(3)], {2: "depth limit exceeded"}),
    "deep_100_ok": ("deep100.jsonl", line(1, x=json.loads("[" * 100 + "]" * 100)) + b"\n" + line(2) + b"\n",
                    [rec(1, x=json.loads("[" * 100 + "]" * 100)), rec(2)], {}),
    "array_named_jsonl": ("array.jsonl", b"[" + line(1) + b",\n " + line(2) + b"]\n", [rec(1), rec(2)], {}),
    "gzip_named_jsonl": ("gz.jsonl", gzip.compress(line(1) + b"\nnull\n" + line(3) + b"\n"), [rec(1), rec(3)],
                         {2: "expected a JSON object"}),
    "wide_int": ("wide.jsonl", line(1, id=WIDE) + b"\n" + line(2, id=-WIDE) + b"\n", [rec(1, id=WIDE), rec(2, id=-WIDE)], {}),
    "nan_infinity": ("nan.jsonl", line(1) + b'\n{"instruction": "q", "output": "a", "score": NaN}\n'
                     b'{"instruction": "q", "output": "a", "score": Infinity}\n'
                     b'{"instruction": "q", "output": "a", "score": -Infinity}\n' + line(5) + b"\n",
                     [rec(1), rec(5)], {2: "unexpected character", 3: "unexpected character", 4: "no digit after sign"}),
    "tru_and_escapes": ("tru.jsonl", line(1) + b'\n{"instruction": tru, "output": "a"}\n{"instruction": "\\x", "output": "a"}\n'
                        b'{"instruction": "\\ud800", "output": "a"}\n' + line(5) + b"\n",
                        [rec(1), rec(5)], {2: "expected 'true'", 3: "invalid escape", 4: "surrogate"}),
    "trailing_and_two": ("glued.jsonl", line(1) + b" x\n" + line(2) + line(3) + b"\n" + line(4) + b" " + line(5) + b"\n"
                         + line(6) + b"\n", [rec(6)], {1: "unexpected content", 2: "unexpected content", 3: "unexpected content"}),
    "null_first_and_non_objects": ("null.jsonl", b"null\n[1]\n\"x\"\n" + line(4) + b"\n", [rec(4)],
                                   {1: "NoneType", 2: "got list", 3: "got str"}),
    "blank_crlf_whitespace": ("crlf.jsonl", line(1) + b"\r\n\r\n   \n\t\n" + line(5) + b"\r\n", [rec(1), rec(5)], {}),
    "truncated_last_line": ("trunc.jsonl", line(1) + b'\n{"instruction": "q2", "out', [rec(1)], {2: "unexpected end"}),
    "last_line_without_newline": ("nonl.jsonl", line(1) + b"\n" + line(2), [rec(1), rec(2)], {}),
    "array_bad_elements": ("arr.json", b"[" + line(1) + b', {"instruction": NaN}, null,\n  ' + line(4) + b"]",
                           [rec(1), rec(4)], {2: "unexpected character", 3: "NoneType"}),
}


def cli(*args):
    "Run an `unsloth-prep` command in a fresh process: (exit code, JSON summary or None, stderr)."
    p = subprocess.run([sys.executable, "-c", "import sys; from unsloth_prep.cli import main; sys.exit(main())",
                        *map(str, args)], capture_output=True, text=True, timeout=300)
    out = p.stdout.strip().splitlines()
    summary = json.loads(out[-1]) if out and out[-1].startswith("{") else None
    return p.returncode, summary, p.stderr


def table(out):
    "The converted rows of an output folder, as one table."
    return pq.read_table(data_files(out))


def convert_sharded(src, out, **options) -> dict:
    "`unsloth-prep convert SRC --out OUT` with these options, in this process (workers are spawned): the summary."
    import argparse, contextlib, io
    from unsloth_prep.pipeline import convert_args, convert_main
    p = argparse.ArgumentParser()
    convert_args(p)
    argv = [str(src), "--out", str(out), "--no-progress"]
    for k, v in options.items(): argv += [f"--{k.replace('_', '-')}", str(v)]
    with contextlib.redirect_stdout(io.StringIO()): return convert_main(p.parse_args(argv))


def as_row(r, columns, text_fields):
    "A record as convert's row: every column present, values of JSON-text fields (wide ints, too deep) as JSON text."
    text = lambda v: v if v is None or isinstance(v, str) else json.dumps(v, separators=(",", ":"))
    return {c: text(r.get(c)) if c in text_fields else r.get(c) for c in columns}


@pytest.mark.parametrize("case", list(CASES))
def test_same_records_same_rejects(tmp_path, case):
    name, data, accepted, bad = CASES[case]
    src = tmp_path / name
    src.write_bytes(data)
    # the shared reader, in process: the records, exact
    rej = Rejects(keep=None)
    assert [r for _, r in iter_file(src, "skip", rej)] == accepted
    expected = sorted(bad.items())
    assert [o["line"] for o in rej.items] == [n for n, _ in expected]
    for (n, why), o in zip(expected, rej.items): assert why in o["error"], (n, why, o["error"])
    reasons = [(o["line"], o["error"]) for o in rej.items]
    # inspect
    code, s, err = cli("inspect", src, "--rejects", tmp_path / "inspect.rejects.jsonl")
    assert code == 0, err
    assert (s["records"], s["malformed"], s["invalid"]) == (len(accepted), len(bad), 0)
    got = [json.loads(l) for l in open(tmp_path / "inspect.rejects.jsonl")] if bad else []
    assert [(o["line"], o["error"]) for o in got] == reasons
    # convert: same rows, same rejects, and the Parquet reads back
    code, s, err = cli("convert", src, tmp_path / "out", "--no-progress")
    assert code == 0, err
    assert (s["rows"], s["rejected"]) == (len(accepted), len(bad))
    rows = table(tmp_path / "out").to_pylist()
    assert rows == [as_row(r, rows[0].keys(), s["json_text_fields"]) for r in accepted]
    assert set(s["json_text_fields"]) == {"wide_int": {"id"}, "deep_100_ok": {"x"}}.get(case, set())
    if bad: assert s["rejects"] == str(tmp_path / "out" / REJECTS)
    got = [json.loads(l) for l in open(s["rejects"])] if bad else []
    assert [(o["line"], o["error"]) for o in got] == reasons
    # doctor (no tokenizer: the data checks); it shows the first three rejected lines and the first reason
    code, s, err = cli("doctor", src)
    assert s is not None, err
    assert s["checked"] == len(accepted)
    found = {f["code"]: f for f in s["findings"]}
    if bad:
        assert found["malformed_line"]["count"] == len(bad)
        assert found["malformed_line"]["examples"] == [n for n, _ in reasons][:3]
        assert found["malformed_line"]["detail"] == reasons[0][1]
    else:
        assert "malformed_line" not in found


def test_wide_ints_counted_as_coerced(tmp_path):
    "An ID beyond 64 bits stays exact in the Parquet output, as text, and the summary counts it."
    name, data, accepted, _ = CASES["wide_int"]
    (tmp_path / name).write_bytes(data)
    code, s, err = cli("convert", tmp_path / name, tmp_path / "out", "--no-progress")
    assert code == 0, err
    assert s["coerced"] == {"id": 2}
    assert table(tmp_path / "out")["id"].to_pylist() == [str(WIDE), str(-WIDE)]


def test_empty_file_and_directory(tmp_path):
    "An empty file has no records for any command; a directory is not a convert source (exit 2, named)."
    (tmp_path / "empty.jsonl").write_bytes(b"")
    code, _, err = cli("inspect", tmp_path / "empty.jsonl")
    assert code == 2 and "empty.jsonl" in err and "no records" in err
    code, s, err = cli("convert", tmp_path / "empty.jsonl", tmp_path / "out", "--no-progress")
    assert code == 0 and (s["rows"], s["rejected"]) == (0, 0), err
    assert len(data_files(tmp_path / "out")) == 1 and table(tmp_path / "out").num_rows == 0
    code, s, err = cli("doctor", tmp_path / "empty.jsonl")
    assert s["checked"] == 0, err
    (tmp_path / "d").mkdir()     # a folder is read as its data files: none here
    code, _, err = cli("convert", tmp_path / "d", tmp_path / "dout", "--no-progress")
    assert code == 2 and f"{tmp_path / 'd'}: no such data file" in err and "Traceback" not in err
    assert not (tmp_path / "dout").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_convert_workers_equal_one_process(tmp_path, case):
    "Byte ranges converted by worker processes (3 ranges, 2 workers) give the one-process table and rejects file."
    from unsloth_prep.convert import convert
    name, data, accepted, bad = CASES[case]
    src = tmp_path / name
    src.write_bytes(data)
    one = convert(src, tmp_path / "one.parquet", progress=False)
    many = convert_sharded(src, tmp_path / "many", workers=2, shards=3)
    assert table(tmp_path / "many").equals(pq.read_table(tmp_path / "one.parquet"))
    keys = ("rows", "rejected", "blank", "lines", "coerced", "json_text_fields", "columns", "input_bytes")
    assert {k: many[k] for k in keys} == {k: one[k] for k in keys}
    if bad: assert Path(many["rejects"]).read_bytes() == Path(one["rejects"]).read_bytes()
    else: assert one["rejects"] is None and not (tmp_path / "one.rejects.jsonl").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_convert_with_nothing_rejected_has_no_rejects_file(tmp_path, workers):
    name, data, _, _ = CASES["blank_crlf_whitespace"]
    (tmp_path / name).write_bytes(data)
    s = convert_sharded(tmp_path / name, tmp_path / "many", workers=workers, shards=3)
    assert s["rejected"] == 0 and s["rejects"] is None and not (tmp_path / "many" / REJECTS).exists()


def test_convert_workers_schema_drift_across_ranges(tmp_path):
    "Types that change between byte ranges end as one process ends them: widened, or JSON text, counted the same."
    rows = [{"id": i, "n": i, "when": "2024-01-02", "meta": None, "tags": "a"} for i in range(300)]
    rows += [{"id": f"k{i}", "n": i + 0.5, "when": "2024-01-03", "meta": {"src": "x"}, "tags": ["a", i]}
             for i in range(300)]
    rows += [{"id": i, "n": None, "extra": True} for i in range(300)]
    src = tmp_path / "drift.jsonl"
    src.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    from unsloth_prep.convert import convert
    one = convert(src, tmp_path / "one.parquet", progress=False, block_mb=0.01)
    many = convert_sharded(src, tmp_path / "many", workers=2, shards=5, block_mb=0.01)
    assert many["shards"] == 5
    assert table(tmp_path / "many").equals(pq.read_table(tmp_path / "one.parquet"))
    assert (many["coerced"], many["json_text_fields"]) == (one["coerced"], one["json_text_fields"])
    assert one["coerced"] == {"id": 600, "tags": 300, "n": 300}  # id's ints and tags' lists as JSON text; n's ints as floats
