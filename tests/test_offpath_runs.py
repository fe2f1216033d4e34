"""Off the happy path in `pack`, `doctor`, `plan` and `train`: every bad input ends in exit 2 with one line naming the
file and the option or key (never a traceback), an input is never written to, a full disk, a read-only folder or
Ctrl-C leave no temporary file behind, and `train` refuses a config that disagrees with the data it was prepared for.
Each command runs in a fresh process; faults that cannot be produced for real here are injected into that process."""
import hashlib, json, os, shutil, subprocess, sys, textwrap, time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from clitools import last_json, run
from unsloth_prep.config import load_config
from unsloth_prep.fixtures import tiny_model, write_records
from unsloth_prep.outputs import data_files

CLI = (shutil.which("unsloth-prep"),) if shutil.which("unsloth-prep") else (
    sys.executable, "-c", "import sys; from unsloth_prep.cli import main; sys.exit(main())")


OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}  # no network at test time: a Hub name fails at once, no retries


def cli(*args, timeout=300):
    "Run `unsloth-prep ARGS` in a fresh process, offline (the exit status is the caller's to check)."
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=OFFLINE)


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def refused(proc, *words):
    "Exit 2, no traceback, and a last stderr line that names every one of `words`."
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err[-2000:], proc.stdout[-1000:])
    assert "Traceback" not in err, err[-3000:]
    line = err.splitlines()[-1]
    for w in words: assert str(w) in line, (w, line)
    return line


def tokenized(path, lengths=(5, 7, 9, 30, 12, 3)) -> Path:
    "A small tokenized Parquet file (input_ids, attention_mask, labels) with rows of the given lengths."
    rows = [{"input_ids": list(range(1, n + 1)), "attention_mask": [1] * n, "labels": [-100] * 2 + list(range(3, n + 1))}
            for n in lengths]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return Path(path)


def leftovers(folder, keep) -> list:
    "Files in `folder` (hidden ones too, recursively) other than `keep`."
    keep = {Path(k).name for k in keep}
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.name not in keep)


# ---------------------------------------------------------------- an output that is an input
@pytest.mark.parametrize("case", ["dst_is_src", "dst_holds_src", "default_rejects_is_src"])
def test_pack_never_writes_over_its_input(tmp_path, case):
    # default_rejects_is_src: the input is OUT/rejects.parquet, where pack puts its overlong rows
    src = tokenized(_mkdir(tmp_path / "o") / "rejects.parquet") if case == "default_rejects_is_src" \
        else tokenized(tmp_path / "data.parquet")
    before = digest(src)
    args = {"dst_is_src": [src, src], "dst_holds_src": [src, tmp_path],
            "default_rejects_is_src": [src, tmp_path / "o"]}[case]
    p = cli("pack", *args, "--max-seq-length", 16, "--no-progress")
    refused(p, src.name)
    assert digest(src) == before and leftovers(tmp_path, [src, "o"]) == []
    if case == "default_rejects_is_src": assert sorted(f.name for f in (tmp_path / "o").iterdir()) == [src.name]


def _mkdir(d):
    Path(d).mkdir(parents=True, exist_ok=True)
    return Path(d)


@pytest.mark.parametrize("flag", ["--rejects", "--write-clean"])
@pytest.mark.parametrize("where", ["same_file", "inside_input_folder"])
def test_doctor_never_writes_over_its_input(tmp_path, flag, where):
    folder = tmp_path / "data"
    folder.mkdir()
    data = folder / "train.jsonl"
    write_records(data, n=40, seed=3)
    with open(data, "a") as f: f.write('{"instruction": "broken\n')
    before = digest(data)
    target, given = (data, data) if where == "same_file" else (folder / "out.jsonl", folder)
    p = cli("doctor", given, flag, target, "--no-progress")
    refused(p, target.name if where == "same_file" else "data")
    assert digest(data) == before and sorted(f.name for f in folder.iterdir()) == ["train.jsonl"]


def test_train_outputs_never_replace_its_data(tmp_path):
    # output_dir: the data's own folder is fine (train writes adapter/, checkpoints/, report.*), the data being
    # one of those outputs is not
    data = tokenized(tmp_path / "report.json")
    before = digest(data)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"path": "report.json"}, "model": {"name": "llama-3.2-1b"},
                                   "max_seq_length": 64, "output_dir": "."}))
    refused(cli("train", cfg), "report.json")
    assert digest(data) == before


# ---------------------------------------------------------------- numeric options range-checked at parse time
@pytest.mark.parametrize("argv, option", [
    (["pack", "{src}", "{out}", "--max-seq-length", "0"], "--max-seq-length"),
    (["pack", "{src}", "{out}", "--max-seq-length", "-16"], "--max-seq-length"),
    (["pack", "{src}", "{out}", "--max-seq-length", "sixteen"], "--max-seq-length"),
    (["doctor", "{src}", "--sample", "0"], "--sample"),
    (["doctor", "{src}", "--max-seq-length", "0"], "--max-seq-length"),
    (["plan", "--model", "llama-3.2-1b", "--gpu", "T4", "--lora-rank", "0"], "--lora-rank"),
    (["plan", "--model", "llama-3.2-1b", "--gpu", "T4", "--max-seq-length", "-1"], "--max-seq-length"),
    (["plan", "--model", "llama-3.2-1b", "--gpu", "T4", "--effective-batch", "0"], "--effective-batch"),
])
def test_numeric_options_are_range_checked(tmp_path, argv, option):
    src = tokenized(tmp_path / "data.parquet")
    before = digest(src)
    argv = [a.format(src=src, out=tmp_path / "out") for a in argv]
    p = cli(*argv)
    refused(p, option)
    assert "ZeroDivisionError" not in p.stderr and digest(src) == before
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- full disk, read-only folder, Ctrl-C
FAULTS = {  # code run in the fresh process before the CLI: a fault the writer meets on its first Parquet write
    "enospc": "raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))",
    "sigint": "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)",
}


def with_fault(fault: str, *args, timeout=120):
    "Run the CLI in a fresh process whose Parquet writes meet `fault` (ENOSPC, or Ctrl-C in the middle of the run)."
    code = textwrap.dedent(f"""
        import errno, os, signal, sys, time
        import pyarrow.parquet as pq
        real = pq.ParquetWriter.write_table
        def write_table(self, *a, **k):
            {FAULTS[fault]}
        pq.ParquetWriter.write_table = write_table
        from unsloth_prep.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=OFFLINE)


def test_pack_on_a_full_disk_names_the_file_and_leaves_nothing(tmp_path):
    # ENOSPC injected into the Parquet writer of the fresh process (a real full disk: see the tmpfs test below)
    src = tokenized(tmp_path / "data.parquet", lengths=(5, 7, 9, 30, 12, 3) * 50)
    before = digest(src)
    out = tmp_path / "out" / "packed"
    p = with_fault("enospc", "pack", src, out, "--max-seq-length", 16, "--no-progress")
    refused(p, "packed", "No space left")
    assert digest(src) == before and leftovers(tmp_path, [src, "out"]) == []


@pytest.fixture
def small_fs(tmp_path):
    "A 256 KiB tmpfs (a really full disk) when this process may mount one; None otherwise."
    d = tmp_path / "small"
    d.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)],
                                                   capture_output=True).returncode == 0
    yield d if mounted else None
    if mounted: subprocess.run(["umount", str(d)], capture_output=True)


def test_pack_on_a_really_full_tmpfs(tmp_path, small_fs):
    if small_fs is None: pytest.skip("cannot mount a tmpfs here (the injected ENOSPC test covers this)")
    src = tokenized(tmp_path / "data.parquet", lengths=list(range(100, 400)) * 4)   # ~3 MB of packed output
    before = digest(src)
    p = cli("pack", src, small_fs / "packed", "--max-seq-length", 512, "--no-progress")
    refused(p, "packed", "No space left")
    assert digest(src) == before and leftovers(small_fs, []) == []


@pytest.fixture
def readonly_dir(tmp_path):
    "A folder this process cannot write into: chmod 555, or (as root, where chmod does not stop writes) a read-only tmpfs."
    d = tmp_path / "readonly"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True)
    if r.returncode: pytest.skip(f"root without mount: cannot make a read-only folder ({r.stderr.decode()[:80]})")
    yield d
    subprocess.run(["umount", str(d)], capture_output=True)


def test_pack_into_a_read_only_folder(tmp_path, readonly_dir):
    src = tokenized(tmp_path / "data.parquet")
    before = digest(src)
    p = cli("pack", src, readonly_dir / "packed", "--max-seq-length", 16, "--no-progress")
    refused(p, str(readonly_dir))
    assert digest(src) == before and list(readonly_dir.iterdir()) == []


def test_ctrl_c_in_pack_exits_130_and_leaves_nothing(tmp_path):
    "Ctrl-C: exit 130, no output and no half-written file; only the hidden build (its journal, for a resume), which the"
    " next run takes over and removes."
    from unsloth_prep.outputs import build_dir
    src = tokenized(tmp_path / "data.parquet", lengths=(5, 7, 9, 30, 12, 3) * 50)
    before = digest(src)
    out = tmp_path / "out" / "packed"
    t0 = time.perf_counter()
    p = with_fault("sigint", "pack", src, out, "--max-seq-length", 16, "--no-progress")
    err = p.stderr.strip()
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert time.perf_counter() - t0 < 60
    build = build_dir(out)
    assert digest(src) == before and not out.exists() and not list(build.rglob("*.parquet*"))
    assert [f for f in leftovers(tmp_path, [src, "out"]) if not f.startswith(f"out/{build.name}")] == []
    assert cli("pack", src, out, "--max-seq-length", 16, "--no-progress").returncode == 0
    assert not build.exists() and [f for f in leftovers(tmp_path, [src, "out"]) if not f.startswith("out/packed")] == []


# ---------------------------------------------------------------- the config reader
GOOD = {"data": {"path": "prepared.parquet"}, "model": {"name": "llama-3.2-1b"}, "max_seq_length": 512}


def bomb(levels: int = 9, width: int = 9) -> str:
    "A billion-laughs YAML: `levels` anchors, each a list of `width` aliases to the previous one."
    lines = ["trainer:", f"  a0: &a0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines + ["data: {path: prepared.parquet}", "model: {name: llama-3.2-1b}", "max_seq_length: 512"])


BAD_CONFIGS = {  # name -> (YAML text, overrides, words the message must hold)
    "set_under_a_string": (yaml.safe_dump(GOOD), {"data.path.x": 1}, ["data.path"]),
    "set_under_an_int": (yaml.safe_dump(GOOD), {"max_seq_length.a": 1}, ["max_seq_length"]),
    "nested_path_list": (yaml.safe_dump({**GOOD, "data": {"path": [["a.parquet", "b.parquet"]]}}), {}, ["data.path"]),
    "python_tag": ("data: {path: !!python/object/apply:os.system [\"echo hacked\"]}\nmodel: {name: x}\n"
                   "max_seq_length: 8\n", {}, ["python/object", "line 1"]),
    "billion_laughs": (bomb(), {}, ["alias"]),
    "negative_learning_rate": (yaml.safe_dump({**GOOD, "trainer": {"learning_rate": -1}}), {},
                               ["trainer.learning_rate", "-1"]),
    "zero_batch": (yaml.safe_dump({**GOOD, "trainer": {"per_device_train_batch_size": 0}}), {},
                   ["trainer.per_device_train_batch_size"]),
    "zero_epochs": (yaml.safe_dump({**GOOD, "trainer": {"num_train_epochs": 0}}), {}, ["trainer.num_train_epochs"]),
    "zero_max_steps": (yaml.safe_dump({**GOOD, "trainer": {"max_steps": 0}}), {}, ["trainer.max_steps"]),
    "rank_zero": (yaml.safe_dump({**GOOD, "lora": {"r": 0}}), {}, ["lora.r"]),
    "dropout_over_one": (yaml.safe_dump({**GOOD, "lora": {"dropout": 1.5}}), {}, ["lora.dropout"]),
    "eval_fraction_one": (yaml.safe_dump({**GOOD, "data": {"path": "p.parquet", "eval_fraction": 1.0}}), {},
                          ["data.eval_fraction"]),
    "workers_zero": (yaml.safe_dump({**GOOD, "data": {"path": "p.parquet", "workers": 0}}), {}, ["data.workers"]),
    "mapping_not_a_dict": (yaml.safe_dump({**GOOD, "data": {"path": "p.parquet", "mapping": "output=answer"}}), {},
                           ["data.mapping"]),
    "not_a_mapping": ("- just\n- a list\n", {}, ["top level"]),
    "broken_yaml": ("data: {path: [unclosed\nmodel: x\n", {}, ["line"]),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_is_one_valueerror_naming_file_and_key(tmp_path, name):
    text, overrides, words = BAD_CONFIGS[name]
    f = tmp_path / f"{name}.yaml"
    f.write_text(text)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        load_config(f, overrides)
    msg = str(e.value)
    assert time.perf_counter() - t0 < 5, "the reader must not expand an alias bomb"
    assert str(f) in msg and "\n" not in msg, msg
    for w in words: assert w in msg, (w, msg)


@pytest.mark.parametrize("name", ["set_under_a_string", "nested_path_list", "python_tag", "billion_laughs",
                                  "negative_learning_rate"])
def test_train_refuses_a_bad_config_in_one_line(tmp_path, name):
    text, overrides, words = BAD_CONFIGS[name]
    f = tmp_path / "run.yaml"
    f.write_text(text)
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    p = cli("train", f, *sets, timeout=60)
    refused(p, "run.yaml", *words)
    assert "hacked" not in p.stdout.splitlines()


@pytest.mark.parametrize("value, words", [('!!python/object/apply:os.system ["echo hacked"]', ["python/object"]),
                                          ("[&a [x, x, x, x, x, x, x, x, x, x], " + ", ".join(["[*a, *a, *a, *a, *a]"] * 3)
                                           + "]", []),
                                          ("{unclosed: [", ["not valid YAML"])])
def test_train_set_values_are_read_safely(tmp_path, value, words):
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(GOOD))
    p = cli("train", f, "--set", f"lora.modules_to_save={value}", timeout=60)
    assert "hacked" not in p.stdout.splitlines()
    if words: refused(p, "--set", *words)
    else: refused(p, "lora.modules_to_save", "list of strings")  # small aliases are read; the nested list is refused


def test_the_raw_data_keys_share_the_training_schema(tmp_path):
    # the keys `prepare --config` reads sit in the same schema as the ones `train` reads: checked, defaulted,
    # relative paths taken from the config file's folder
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({**GOOD, "task": "sft", "template": "chatml", "packing": True, "data": {
        "path": "prepared.parquet", "source": "raw/*.jsonl", "format": "sharegpt", "mapping": {"messages": "turns"},
        "eval_fraction": 0.1, "split_seed": 7, "dedup": True, "workers": 2, "engine": "local"}}))
    d = load_config(f)["data"]
    assert d["source"] == str(tmp_path / "raw/*.jsonl") and d["format"] == "sharegpt" and d["workers"] == 2
    assert d["mapping"] == {"messages": "turns"} and d["eval_fraction"] == 0.1 and d["dedup"] is True
    plain = load_config({**GOOD})["data"]
    assert plain["source"] is None and plain["workers"] == 1 and plain["engine"] == "local"
    with pytest.raises(ValueError, match="data.engine"):
        load_config({**GOOD, "data": {"path": "p.parquet", "engine": "spark"}})


# ---------------------------------------------------------------- train: max_steps and the prepared settings
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    "A tokenizer, 24 conversations prepared by the CLI at max_seq_length 128 (its settings recorded), and a run folder."
    d = tmp_path_factory.mktemp("prepared")
    model = tiny_model()
    write_records(d / "raw.jsonl", n=24, seed=11)
    run(*CLI, "prepare", d / "raw.jsonl", "--tokenizer", model, "--max-seq-length", 128, "--out",
        d / "prepared", "--no-progress")
    return {"dir": d, "model": str(model), "data": d / "prepared"}


def _train_cfg(prepared, name="run.yaml", **kw) -> Path:
    cfg = {"data": {"path": str(prepared["data"])}, "model": {"name": prepared["model"], "cpu_threads": 2},
           "max_seq_length": 128, "trainer": {"max_steps": 2, "per_device_train_batch_size": 4, "warmup_steps": 0},
           "output_dir": str(prepared["dir"] / name.replace(".yaml", "")), "generate": None, **kw}
    f = prepared["dir"] / name
    f.write_text(yaml.safe_dump(cfg))
    return f


MISMATCHES = [(dict(max_seq_length=256), "max_seq_length", "128", "256"),
              (dict(template="chatml"), "template", "None", "chatml"),
              (dict(task="dpo"), "task", "sft", "dpo"),
              (dict(model={"name": "unsloth/Llama-3.2-1B-Instruct"}), "model.name", "tiny-llama", "Llama-3.2-1B")]


@pytest.mark.parametrize("change, key, theirs, ours", MISMATCHES)
def test_train_stops_when_config_and_prepared_data_disagree(prepared, change, key, theirs, ours):
    # the settings `prepare` itself recorded (outputs.settings_of the CLI's output folder: its manifest)
    f = _train_cfg(prepared, f"mismatch_{key}.yaml", **change)
    t0 = time.perf_counter()
    p = cli("train", f, timeout=120)
    line = refused(p, prepared["data"], key, theirs, ours)
    assert time.perf_counter() - t0 < 60, "the check runs before the model is loaded"
    assert not (prepared["dir"] / f"mismatch_{key}" / "adapter").exists(), line


@pytest.mark.parametrize("change, key, theirs, ours", MISMATCHES)
def test_train_compares_the_recorded_settings(tmp_path, change, key, theirs, ours):
    # the same check on one Parquet file's settings (outputs.settings_of reads its key-value metadata)
    from unsloth_prep.base import ParquetSink
    model = str(tiny_model())
    data = tmp_path / "prepared.parquet"
    with ParquetSink(data, metadata={"task": "sft", "template": None, "max_seq_length": 128, "tokenizer": model}) as s:
        s.write(pa.table({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}))
    cfg = {"data": {"path": "prepared.parquet"}, "model": {"name": model}, "max_seq_length": 128,
           "output_dir": "run", "generate": None, **change}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    refused(cli("train", tmp_path / "run.yaml", timeout=120), "prepared.parquet", key, theirs, ours)
    assert not (tmp_path / "run").exists()


def test_train_with_max_steps_minus_one_trains_the_epochs_and_says_so(prepared):
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in data_files(prepared["data"]))
    f = _train_cfg(prepared, "epochs.yaml", trainer={"max_steps": -1, "num_train_epochs": 1,
                                                      "per_device_train_batch_size": 4, "warmup_steps": 0})
    p = cli("train", f, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    s = last_json(p)
    assert s["steps"] == -(-rows // 4) and "num_train_epochs" in p.stdout and "max_steps" in p.stdout
    assert Path(s["adapter"], "adapter_config.json").exists()
