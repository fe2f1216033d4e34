"""Shared by the storage tests: a real S3 server (moto's server mode) on 127.0.0.1, its endpoint and dummy credentials
in this process's environment (the commands the tests run inherit them), and the data it holds."""
import json, logging, os, socket
from contextlib import contextmanager
from pathlib import Path

from unsloth_prep.fixtures import write_records

BUCKET = "prep-data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve():
    "Start the server; set its endpoint and dummy credentials in the environment; restore both on exit."
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)         # no request log on the test's stderr
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_PROFILE", "AWS_SESSION_TOKEN"]}
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"): os.environ.pop(k, None)
    os.environ.update(env)
    try: yield
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v


def fill(d: Path):
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
