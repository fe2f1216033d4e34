"""Off the happy path, for the readers (`loading`, `convert`): every bad input below ends in an accounted result or
exit 2 with one line naming the file, never a traceback or a hang, and an input is never written to. The corpus is
written here, in `tmp_path`; commands run in fresh processes."""
import bz2, gzip, hashlib, json, lzma, os, subprocess, sys, threading, time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unsloth_prep.loading import (iter_conversations, normalize_record, plan_shards, read_dataset_info, resolve_files)
from unsloth_prep.outputs import data_files

LAUNCH = "import sys; from unsloth_prep.cli import main; sys.exit(main())"
NO_ZSTD = "import sys; sys.modules['zstandard'] = None; from unsloth_prep.cli import main; sys.exit(main())"
# `open` refusing one path as an unreadable file does (the tests run as root, who can read any file)
DENY = ("import builtins, sys; _o = builtins.open\n"
        "def _deny(f, *a, **k):\n"
        "    if str(f).endswith('denied.jsonl'): raise PermissionError(13, 'Permission denied', str(f))\n"
        "    return _o(f, *a, **k)\n"
        "builtins.open = _deny\n" + LAUNCH)


def cli(*args, launch=LAUNCH, input=None, env=None, timeout=120):
    "Run `unsloth-prep ARGS` in a fresh process (`input`: bytes piped to its stdin): (exit code, summary, out, err)."
    p = subprocess.run([sys.executable, "-c", launch, *map(str, args)], capture_output=True, timeout=timeout,
                       input=input if input is not None else b"", env={**os.environ, **(env or {})})
    out, err = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    last = [l for l in out.splitlines() if l.startswith("{")]
    return p.returncode, (json.loads(last[-1]) if last else None), out, err


def convert(src, dst, *extra, **kw):
    "`unsloth-prep convert SRC DST ...` (no progress bar)."
    return cli("convert", src, dst, "--no-progress", *extra, **kw)


def inspect(*args, **kw):
    "`unsloth-prep inspect ...` (no progress bar)."
    return cli("inspect", *args, "--no-progress", **kw)


def refused(res, *words):
    "Assert a command exited 2 with a one-line message (no traceback) that contains every word."
    rc, _, out, err = res
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    for w in words: assert str(w) in err, (w, err[-2000:])
    return err


def digest(path) -> str: return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def alpaca(i, **extra): return {"instruction": f"q{i}", "output": f"a{i}", **extra}


def write_jsonl(path, recs):
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    return Path(path)


# ---------------------------------------------------------------- streams that are not regular files
def test_stdin_pipe_is_never_an_empty_success(tmp_path):
    data = "".join(json.dumps(alpaca(i)) + "\n" for i in range(50)).encode()
    for res in (convert("/dev/stdin", tmp_path / "o", input=data), inspect("/dev/stdin", input=data)):
        rc, s, out, err = res
        assert "Traceback" not in err, err
        if rc == 0: assert s.get("rows", s.get("records")) == 50, s       # read it all, or
        else: refused(res, "/dev/stdin", "not a regular file")              # refuse it by name


def test_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    refused(convert(fifo, tmp_path / "o", timeout=60), fifo, "not a regular file")
    refused(inspect(fifo, timeout=60), fifo, "not a regular file")
    with pytest.raises(ValueError, match="not a regular file"): resolve_files(str(fifo))


# ---------------------------------------------------------------- numbers survive exactly
BIG = 9007199254740993     # 2**53 + 1: the first integer a double cannot hold


def _read_back(out):
    "The schema and rows of a converted output folder."
    t = pq.read_table(data_files(out))
    return t.schema, t.to_pylist()


def test_int_and_float_in_one_block(tmp_path):
    src = write_jsonl(tmp_path / "mix.jsonl", [{"x": 1, "y": BIG, "z": 7}, {"x": 1.5, "y": 2.5, "z": 8}])
    rc, s, _, err = convert(src, tmp_path / "o")
    assert rc == 0, err
    schema, rows = _read_back(tmp_path / "o")
    assert [r["x"] for r in rows] == [1.0, 1.5] and s["coerced"]["x"] == 1            # 1 -> 1.0, counted
    assert [json.loads(r["y"]) for r in rows] == [BIG, 2.5]                            # kept exactly, as JSON text
    assert type(json.loads(rows[0]["y"])) is int and s["coerced"]["y"] == 2
    assert "y" in s["json_text_fields"] and schema.field("z").type == pa.int64() and "z" not in s["coerced"]


def test_int_and_float_across_blocks(tmp_path):
    filler = "w" * 3000
    recs = [{"y": BIG + i, "t": filler} for i in range(200)] + [{"y": 0.5, "t": filler}]
    recs += [{"x": i, "t": filler} for i in range(200)] + [{"x": 2.25, "t": filler}]
    src = write_jsonl(tmp_path / "drift.jsonl", recs)
    rc, s, _, err = convert(src, tmp_path / "o", "--block-mb", "0.1")
    assert rc == 0, err
    from unsloth_prep.convert import convert as convert_file   # what each shard runs: the rows span many blocks
    assert convert_file(src, tmp_path / "lib.parquet", block_mb=0.1, progress=False)["blocks"] > 4
    _, rows = _read_back(tmp_path / "o")
    ys = [json.loads(r["y"]) for r in rows if r["y"] is not None]
    assert ys == [BIG + i for i in range(200)] + [0.5]
    assert [r["x"] for r in rows if r["x"] is not None] == list(range(200)) + [2.25]
    assert s["coerced"]["y"] == 201 and s["coerced"]["x"] == 200


def test_nested_big_int_beside_float(tmp_path):
    src = write_jsonl(tmp_path / "nest.jsonl", [{"m": {"v": BIG}}, {"m": {"v": 0.5}}])
    rc, s, _, err = convert(src, tmp_path / "o")
    assert rc == 0, err
    _, rows = _read_back(tmp_path / "o")
    vals = [r["m"] if isinstance(r["m"], dict) else json.loads(r["m"]) for r in rows]
    vals = [v["v"] if isinstance(v["v"], (int, float)) else json.loads(v["v"]) for v in vals]
    assert vals == [BIG, 0.5] and type(vals[0]) is int
    assert sum(s["coerced"].values()) >= 1


# ---------------------------------------------------------------- a record with 20,000 keys stays linear
def test_twenty_thousand_keys(tmp_path):
    wide = {f"k{i}": i for i in range(20_000)}
    src = write_jsonl(tmp_path / "wide.jsonl", [alpaca(0, **wide), alpaca(1)])
    rc, s, _, err = convert(src, tmp_path / "o", timeout=90)   # a hang, not a speed target
    assert rc == 0, err
    assert s["rows"] == 2 and len(pq.ParquetFile(data_files(tmp_path / "o")[0]).schema_arrow) == 20_002
    rc, s, _, err = inspect(src, timeout=90)
    assert rc == 0 and s["records"] == 2, err


# ---------------------------------------------------------------- messages, not tracebacks
def test_unreadable_inputs(tmp_path):
    d = tmp_path / "folder.jsonl"
    d.mkdir()
    refused(convert(d, tmp_path / "o"), d)
    denied = write_jsonl(tmp_path / "denied.jsonl", [alpaca(0)])
    refused(convert(denied, tmp_path / "o", launch=DENY), denied, "ermission denied")
    refused(inspect(denied, launch=DENY), denied, "ermission denied")


@pytest.mark.parametrize("suffix,compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_truncated_compressed(tmp_path, suffix, compress):
    raw = "".join(json.dumps(alpaca(i, pad="x" * (i % 97))) + "\n" for i in range(3000)).encode()
    blob = compress(raw)
    src = tmp_path / f"cut.jsonl{suffix}"
    src.write_bytes(blob[: len(blob) // 2])
    before = digest(src)
    refused(convert(src, tmp_path / "o"), src, "truncated")
    refused(inspect(src), src, "truncated")
    assert digest(src) == before and not (tmp_path / "o").exists()


def test_zstd_with_and_without_the_package(tmp_path):
    zstandard = pytest.importorskip("zstandard", reason="zstandard is a requirement in settings.ini")
    raw = "".join(json.dumps(alpaca(i)) + "\n" for i in range(40)).encode()
    src = tmp_path / "d.jsonl.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress(raw))
    rc, s, _, err = convert(src, tmp_path / "o")
    assert rc == 0 and s["rows"] == 40, err
    rc, s, _, err = inspect(src)
    assert rc == 0 and s["records"] == 40, err
    refused(inspect(src, launch=NO_ZSTD), src, "pip install zstandard")
    refused(convert(src, tmp_path / "o2", launch=NO_ZSTD), src, "pip install zstandard")


def test_csv_long_field_and_bad_utf8(tmp_path):
    src = tmp_path / "long.csv"
    src.write_text("instruction,output\nq," + "y" * 200_000 + "\nq2,a2\n", encoding="utf-8")
    rc, s, _, err = inspect(src)
    assert rc == 0 and s["records"] == 2 and s["malformed"] == 0, err
    bad = tmp_path / "latin.csv"
    bad.write_bytes(b"instruction,output\nq1,a1\nq2,caf\xe9\nq3,a3\n")
    rc, s, _, err = inspect(bad)
    assert rc == 0, err
    assert (s["records"], s["malformed"]) == (2, 1)
    assert "line 3" in s["first_rejects"][0] and "UTF-8" in s["first_rejects"][0]
    recs = list(iter_conversations(str(bad), on_error="skip", rejects=(rej := [])))
    assert len(recs) == 2 and [r["line"] for r in rej] == [3]
    with pytest.raises(ValueError, match=r"latin.csv: line 3: .*UTF-8"): list(iter_conversations(str(bad)))


def test_text_corpus_bad_utf8_names_the_line(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_bytes(b"first document\nsecond caf\xe9\nthird\n")
    refused(inspect(src), src, "line 2", "UTF-8")


BAD_RECORDS = [  # (record, words the reason contains); each a bad record, counted and kept with its line
    ({"conversations": [{"from": ["human"], "value": "hi"}, {"from": "gpt", "value": "x"}]}, "role"),
    ({"conversations": [{"from": {"a": 1}, "value": "hi"}, {"from": "gpt", "value": "x"}]}, "role"),
    ({"messages": [{"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": "call it"}]},
     "tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [3]}]},
     "tool_calls"),
    (alpaca(0, history=5), "history"),
    (alpaca(0, history={"q": "a"}), "history"),
    (alpaca(0, history="q a"), "history"),
    (alpaca(0, images=5), "images"),
    (alpaca(0, images={"a": 1}), "images"),
]


def test_bad_field_types_are_counted_records(tmp_path):
    recs = [alpaca(100)] + [r for r, _ in BAD_RECORDS] + [alpaca(101)]
    src = write_jsonl(tmp_path / "bad.jsonl", recs)
    for r, words in BAD_RECORDS:
        fmt = "sharegpt" if "conversations" in r else "openai" if "messages" in r else "alpaca"
        with pytest.raises(ValueError, match=words): normalize_record(r, fmt)
    rej = []
    got = list(iter_conversations(str(src), fmt="auto", on_error="skip", rejects=rej))
    assert len(got) == 2 and [r["line"] for r in rej] == list(range(2, 2 + len(BAD_RECORDS)))
    rc, s, _, err = inspect(src, "--format", "alpaca")
    assert rc == 0, err
    assert (s["invalid"], s["records"]) == (len(BAD_RECORDS), 2)       # as alpaca, the chat records are invalid too
    sg = write_jsonl(tmp_path / "sg.jsonl", [BAD_RECORDS[0][0], BAD_RECORDS[1][0],
                                             {"conversations": [{"from": "human", "value": "a"}]}])
    rc, s, _, err = inspect(sg)
    assert rc == 0 and (s["records"], s["invalid"]) == (1, 2), err
    assert s["first_rejects"][0].startswith(f"{sg}: line 1:")


def test_malformed_mapping_and_columns(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [alpaca(0)])
    for bad in ("{bad", "[1, 2]", '{"output": 3}', '"x"'):
        refused(inspect(src, "--mapping", bad), "--mapping")
    for k, cols in enumerate(([1, 2], "prompt", {"prompt": ["instruction"]})):
        reg = tmp_path / f"reg{k}"
        reg.mkdir()
        write_jsonl(reg / "d.jsonl", [alpaca(0)])
        (reg / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "d.jsonl", "columns": cols}}))
        refused(inspect("--dataset-info", reg, "--name", "mine"), "dataset_info.json", "columns")
    (tmp_path / "reg_e").mkdir()
    (tmp_path / "reg_e" / "dataset_info.json").write_text(json.dumps({"mine": "d.jsonl"}))
    refused(inspect("--dataset-info", tmp_path / "reg_e", "--name", "mine"), "dataset_info.json", "mine")


def test_corrupt_parquet(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + os.urandom(300))
    refused(inspect(junk), junk, "not a valid Parquet file")
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"instruction": ["q"] * 100, "output": ["a"] * 100}), good)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:-30])
    refused(inspect(cut), cut, "not a valid Parquet file")


def test_unknown_name_offline_is_quick(tmp_path):
    t = time.time()
    err = refused(inspect("no-such-owner/no-such-set-xyz", env={"HF_HUB_OFFLINE": "1"}, timeout=60),
                  "no-such-owner/no-such-set-xyz", "offline")
    assert time.time() - t < 30
    refused(inspect(tmp_path / "typo.jsnl", env={"HF_HUB_OFFLINE": "1"}, timeout=60), "typo.jsnl")


# ---------------------------------------------------------------- a registry reads only its own folder
def test_dataset_info_confined(tmp_path):
    secret = write_jsonl(tmp_path / "secret.jsonl", [alpaca(0, output="TOP-SECRET")])
    reg = tmp_path / "repo"
    reg.mkdir()
    write_jsonl(reg / "ok.jsonl", [alpaca(1)])
    (reg / "link.jsonl").symlink_to(secret)
    entries = {"up": "../secret.jsonl", "abs": str(secret), "glob": "../*.jsonl", "deep": "sub/../../secret.jsonl",
               "link": "link.jsonl", "ok": "ok.jsonl"}
    (reg / "dataset_info.json").write_text(json.dumps({k: {"file_name": v} for k, v in entries.items()}))
    for name in ("up", "abs", "glob", "deep", "link"):
        rc, s, out, err = inspect("--dataset-info", reg, "--name", name)
        refused((rc, s, out, err), "dataset_info.json", "outside")
        assert "TOP-SECRET" not in out + err
        with pytest.raises(ValueError, match="outside"): read_dataset_info(reg, name)
    rc, s, _, err = inspect("--dataset-info", reg, "--name", "ok")
    assert rc == 0 and s["records"] == 1, err
    assert read_dataset_info(reg, "up", allow_outside=True)["data"].endswith("secret.jsonl")


# ---------------------------------------------------------------- images stay images
PNG = "data:image/png;base64,iVBORw0KGgo="


def test_typed_image_parts_keep_their_media():
    rec = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is it?"},
                                     {"type": "image_url", "image_url": {"url": PNG}},
                                     {"type": "image", "image": {"bytes": b"\x89PNG", "path": "x.png"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}
    out = normalize_record(rec, "openai")
    assert out["messages"][0]["content"] == "<image>What is it?<image><image>"
    assert out["images"] == ["cat.png", PNG, {"bytes": b"\x89PNG", "path": "x.png"}]
    # a part without a reference points into the record's own images list, in order
    rec2 = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
                         {"role": "assistant", "content": "A dog."}], "images": ["dog.png"]}
    out2 = normalize_record(rec2, "openai")
    assert out2["messages"][0]["content"] == "<image>Describe." and out2["images"] == ["dog.png"]
    with pytest.raises(ValueError, match="1 <image> placeholder"):
        normalize_record({**rec2, "images": []} | {"images": None}, "openai")
    sg = {"conversations": [{"from": "human", "value": "<image>Who?"}, {"from": "gpt", "value": "Me."}],
          "images": ["me.jpg"]}
    assert normalize_record(sg, "sharegpt")["images"] == ["me.jpg"]


def test_parquet_image_struct_survives(tmp_path):
    img = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    t = pa.table({"messages": [[{"role": "user", "content": "<image>Which?"}, {"role": "assistant", "content": "B"}]],
                  "images": pa.array([[{"bytes": b"\x89PNGdata", "path": "b.png"}]], pa.list_(img))})
    pq.write_table(t, tmp_path / "v.parquet")
    (rec,) = list(iter_conversations(str(tmp_path / "v.parquet")))
    assert rec["images"] == [{"bytes": b"\x89PNGdata", "path": "b.png"}]
    assert rec["messages"][0]["content"] == "<image>Which?"


# ---------------------------------------------------------------- shards and the input's safety
def test_json_array_shards_say_so(tmp_path):
    src = tmp_path / "arr.json"
    src.write_text(json.dumps([alpaca(i) for i in range(100)]))
    specs = plan_shards([str(src)], 2)
    assert 1 <= len(specs) <= 2 and all(s["kind"] == "json_array" for s in specs)
    rc, s, out, err = convert(src, tmp_path / "o", "--workers", "2")
    assert rc == 0, err
    assert pq.read_table(data_files(tmp_path / "o")).num_rows == 100 == s["rows"]
    assert s["shards"] == len(specs)
    said = ("one worker", "1 shard", "read whole")
    if len(specs) == 1: assert "arr.json" in err and any(w in err for w in said), err   # said, not silent


def test_rejects_never_overwrites_an_input(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [alpaca(i) for i in range(100)])
    with open(src, "a") as f: f.write("not json\n")
    before = digest(src)
    refused(convert(src, tmp_path / "o", "--rejects", src), src)
    refused(inspect(src, "--rejects", src), src)
    refused(convert(src, src, "--overwrite"), src)
    assert digest(src) == before and not (tmp_path / "o").exists()
