"""Shared by the tests: run a command in a fresh process and read the JSON summary every `unsloth-prep` command prints last."""
import json, subprocess


def run(*args, check=True, timeout=900):
    """Run a command in a fresh process and return it (asserting exit code 0 unless check=False)."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    if check: assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def last_json(proc):
    """The JSON summary on the last line of a command's output."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_rows(out, split="train", columns=None):
    """The rows of a prepared output as a list of dicts, in order, whatever its layout (one file or a folder)."""
    import pyarrow.parquet as pq
    from unsloth_prep.outputs import prepared_files
    return [r for f in prepared_files(out, split) for r in pq.read_table(f, columns=columns).to_pylist()]
