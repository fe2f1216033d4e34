"""Data where it lives: every input may be a URL. A real S3 server (moto's server mode on 127.0.0.1, tests/s3server.py)
holds the data; `prepare` in one process and with workers gives the rows of the local run (Ray actors: in
test_storage_out.py), for JSONL, a glob, Parquet and a `save_to_disk` folder; a missing object or package is a
clear exit 2."""
import sys

import pytest

pytest.importorskip("moto.server", reason="the S3 server tests need moto[server] (dev requirements)")
pytest.importorskip("s3fs", reason="the S3 server tests need s3fs (dev requirements)")

from clitools import last_json, read_rows, run
from unsloth_prep.fixtures import tiny_model

from s3server import BUCKET


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
