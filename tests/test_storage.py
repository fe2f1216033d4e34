"""Data where it lives: every input may be a URL. A real S3 server (moto's server mode on 127.0.0.1) holds the data;
`prepare` in one process, with workers and with Ray actors that open their shards by URL gives the rows of the local
run, for JSONL, a glob, Parquet and a `save_to_disk` folder; a missing object or package is a clear exit 2."""
import json, logging, os, socket, subprocess, sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="the S3 server tests need moto[server] (dev requirements)")
pytest.importorskip("s3fs", reason="the S3 server tests need s3fs (dev requirements)")

from clitools import last_json, read_rows, run
from unsloth_prep.base import MANIFEST
from unsloth_prep.fixtures import tiny_model, write_records

BUCKET = "prep-data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    "A local S3 server holding the test data; its endpoint and dummy credentials in this process's environment."
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)         # no request log on the test's stderr
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"): os.environ.pop(k, None)
    os.environ.update(env)                                          # the commands the tests run inherit it
    try:
        d = tmp_path_factory.mktemp("s3data")
        _fill(d)
        yield d
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v


def _fill(d: Path):
    "Write the local copies and upload them: chat.jsonl, data/part-*.jsonl, chat.parquet, save_to_disk folders."
    import boto3, datasets, pyarrow as pa, pyarrow.parquet as pq, s3fs
    datasets.disable_progress_bars()
    write_records(d / "chat.jsonl", n=400, fmt="sharegpt", malformed_rate=0.01, seed=3)
    lines = (d / "chat.jsonl").read_bytes().splitlines(keepends=True)
    (d / "data").mkdir()
    (d / "data" / "part-0.jsonl").write_bytes(b"".join(lines[:150]))
    (d / "data" / "part-1.jsonl").write_bytes(b"".join(lines[150:]))
    recs = [json.loads(x) for x in lines if _object(x)]
    pq.write_table(pa.Table.from_pylist(recs), d / "chat.parquet", row_group_size=50)
    ds = datasets.Dataset.from_list(recs)
    ds.save_to_disk(str(d / "saved"), num_shards=2)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(40))}).save_to_disk(str(d / "saved_dict"))
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    fs = s3fs.S3FileSystem()
    for name in ("chat.jsonl", "chat.parquet", "data", "saved", "saved_dict"):
        fs.put(str(d / name), f"{BUCKET}/{name}", recursive=True)


def _object(line: bytes) -> bool:
    try: return isinstance(json.loads(line), dict)
    except ValueError: return False


def prepare(data, out, *extra, check=True):
    "`unsloth-prep prepare DATA` in a fresh process (the environment holds the server's endpoint)."
    r = run("unsloth-prep", "prepare", data, "--tokenizer", tiny_model(), "--out", out, "--max-seq-length", "256",
            "--on-error", "skip", "--no-progress", *extra, check=False)
    if check: assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_jsonl_on_s3_gives_the_local_rows_in_one_process_and_with_workers(s3, tmp_path):
    local = read_rows(last_json(prepare(s3 / "chat.jsonl", tmp_path / "local"))["out"])
    one = last_json(prepare(f"s3://{BUCKET}/chat.jsonl", tmp_path / "one"))
    two = last_json(prepare(f"s3://{BUCKET}/chat.jsonl", tmp_path / "two", "--workers", "2"))
    assert len(local) > 100 and read_rows(one["out"]) == local and read_rows(two["out"]) == local
    assert two["shards"] == 2 and one["rejected"] == two["rejected"] > 0


def test_ray_actors_open_their_shards_by_url(s3, tmp_path):
    "`--engine ray --workers 2` on a real local Ray cluster (2 CPUs): the actors read the byte ranges themselves."
    local = read_rows(last_json(prepare(s3 / "chat.jsonl", tmp_path / "local"))["out"])
    url = f"s3://{BUCKET}/chat.jsonl"
    argv = ["unsloth-prep", "prepare", url, "--tokenizer", str(tiny_model()), "--out", str(tmp_path / "ray"),
            "--max-seq-length", "256", "--on-error", "skip", "--no-progress", "--engine", "ray", "--workers", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    s = json.loads(out.strip().splitlines()[-1])
    assert s["engine"] == "ray" and s["shards"] == 2 and read_rows(s["out"]) == local
    m = json.loads((Path(s["out"]) / MANIFEST).read_text())
    assert {p["path"] for sh in m["shards"] for p in sh["source"]} == {url}   # each job names the object, not its rows
    assert {sh["worker"]["pid"] for sh in m["shards"]}.isdisjoint({proc.pid})   # rows made in the actors


def test_a_glob_of_objects(s3, tmp_path):
    local = read_rows(last_json(prepare(str(s3 / "data" / "*.jsonl"), tmp_path / "local"))["out"])
    s = last_json(prepare(f"s3://{BUCKET}/data/*.jsonl", tmp_path / "glob", "--workers", "2"))
    assert len(local) > 100 and read_rows(s["out"]) == local and s["shards"] == 2


def test_a_config_whose_source_is_a_list_of_urls(s3, tmp_path):
    import yaml
    local = read_rows(last_json(prepare(str(s3 / "data" / "*.jsonl"), tmp_path / "local"))["out"])
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": str(tiny_model())}, "max_seq_length": 256, "data": {
        "path": str(tmp_path / "cfg"), "source": [f"s3://{BUCKET}/data/part-{i}.jsonl" for i in (0, 1)]}}))
    r = run("unsloth-prep", "prepare", "--config", cfg, "--on-error", "skip", "--no-progress")
    assert read_rows(last_json(r)["out"]) == local


def test_parquet_on_s3_by_row_groups(s3, tmp_path):
    local = read_rows(last_json(prepare(s3 / "chat.parquet", tmp_path / "local"))["out"])
    one = last_json(prepare(f"s3://{BUCKET}/chat.parquet", tmp_path / "one"))
    two = last_json(prepare(f"s3://{BUCKET}/chat.parquet", tmp_path / "two", "--workers", "2"))
    assert len(local) > 100 and read_rows(one["out"]) == local and read_rows(two["out"]) == local
    assert two["shards"] == 2


def test_a_save_to_disk_folder_here_and_on_s3(s3, tmp_path):
    "The folder `Dataset.save_to_disk` wrote is read as its Arrow files (never its JSON metadata), here and on S3."
    parquet = read_rows(last_json(prepare(s3 / "chat.parquet", tmp_path / "pq"))["out"])
    here = last_json(prepare(s3 / "saved", tmp_path / "here"))
    there = last_json(prepare(f"s3://{BUCKET}/saved", tmp_path / "there", "--workers", "2"))
    assert len(parquet) > 100 and read_rows(here["out"]) == parquet and read_rows(there["out"]) == parquet
    assert there["shards"] == 2                                        # one per Arrow file
    train = last_json(prepare(f"s3://{BUCKET}/saved_dict", tmp_path / "dict_train"))
    test = last_json(prepare(f"s3://{BUCKET}/saved_dict/test", tmp_path / "dict_test"))
    assert read_rows(train["out"]) == parquet and test["records"] == 40


def test_convert_reads_an_object(s3, tmp_path):
    import pyarrow.parquet as pq
    r = run("unsloth-prep", "convert", f"s3://{BUCKET}/chat.jsonl", "--out", tmp_path / "c", "--no-progress")
    local = run("unsloth-prep", "convert", s3 / "chat.jsonl", "--out", tmp_path / "l", "--no-progress")
    assert last_json(r)["rejected"] == last_json(local)["rejected"] > 0
    from unsloth_prep.outputs import data_files
    assert pq.read_table(data_files(tmp_path / "c")[0]).equals(pq.read_table(data_files(tmp_path / "l")[0]))


def test_a_missing_object_is_exit_2_naming_the_url(s3, tmp_path):
    for url in (f"s3://{BUCKET}/nope.jsonl", f"s3://{BUCKET}/data/*.parquet", f"s3://no-such-bucket-x/chat.jsonl"):
        r = prepare(url, tmp_path / "x", check=False)
        assert r.returncode == 2 and url in r.stderr and "Traceback" not in r.stderr, (url, r.stderr[-2000:])
    assert not (tmp_path / "x").exists()


def test_a_url_without_its_package_names_the_extra(s3, tmp_path):
    "Without s3fs (an import that fails, as in a base install) an s3:// input is exit 2 naming the extra."
    code = ("import sys; sys.modules['s3fs'] = None\n"
            "from unsloth_prep.cli import main\nsys.exit(main(sys.argv[1:]))")
    r = run(sys.executable, "-c", code, "prepare", f"s3://{BUCKET}/chat.jsonl", "--tokenizer", tiny_model(),
            "--out", tmp_path / "x", check=False)
    assert r.returncode == 2 and 'pip install "unsloth_prep[cloud]"' in r.stderr and "Traceback" not in r.stderr
    assert f"s3://{BUCKET}/chat.jsonl" in r.stderr


def test_an_object_rewritten_with_the_same_size_changes_its_identity(s3):
    "Resume keys on what the store says of the content (the ETag) now, not on a listing made before the change."
    import boto3
    from unsloth_prep.loading import file_identity, resolve_files
    url = f"s3://{BUCKET}/ident/a.jsonl"
    boto3.client("s3").put_object(Bucket=BUCKET, Key="ident/a.jsonl", Body=b'{"text": "a"}\n')
    assert resolve_files(f"s3://{BUCKET}/ident/*.jsonl") == [url]          # a listing the filesystem caches
    first = file_identity(url)
    boto3.client("s3").put_object(Bucket=BUCKET, Key="ident/a.jsonl", Body=b'{"text": "b"}\n')   # behind its back
    second = file_identity(url)
    assert first["bytes"] == second["bytes"] == 14 and first["ETag"] != second["ETag"]
    assert file_identity(url) == second and second["path"] == url
    boto3.client("s3").put_object(Bucket=BUCKET, Key="ident/b.jsonl", Body=b'{"text": "c"}\n')
    assert len(resolve_files(f"s3://{BUCKET}/ident/*.jsonl")) == 2                 # a new object is seen at once
