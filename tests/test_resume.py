"""Kill and resume: a run killed with SIGKILL after a checkpoint and resumed ends exactly where an uninterrupted run
of the same seed ends (per-step losses after the checkpoint, final adapter weights), for padded, packed and streamed
data; a half-written checkpoint is never resumed from."""
import json, os, shutil, signal, subprocess, sys, time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("unsloth")

CLI = [sys.executable, "-c", "import sys; from unsloth_prep.cli import main; sys.exit(main())"]
STEPS, SAVE_EVERY = 8, 2
# CPU, one thread, float32: the resumed run repeats the same operations in the same order on the same values, so the
# figures are expected to agree bit for bit; the bound leaves room for a BLAS that splits work differently per run.
TOL = 1e-6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from unsloth_prep.fixtures import iter_records, tiny_model
    from unsloth_prep.tokenizer import load_tokenizer
    from unsloth_prep.tokenization import prepare
    d = tmp_path_factory.mktemp("resume")
    model = str(tiny_model())
    prepare(iter_records(80, "openai", seed=5), load_tokenizer(model), d / "prepared.parquet", max_seq_length=128)
    return {"dir": d, "model": model}


def _config(data, name: str, layout: str) -> Path:
    "A run config: padded, packed (packed when loaded) or streamed (packed on the fly, length unknown)."
    cfg = {"data": {"path": "prepared.parquet", "streaming": layout == "streaming"},
           "model": {"name": data["model"], "cpu_threads": 1}, "max_seq_length": 128,
           "packing": layout != "padded", "lora": {"r": 8, "alpha": 16, "modules_to_save": ["lm_head"]},
           "trainer": {"max_steps": STEPS, "save_steps": SAVE_EVERY, "learning_rate": 5e-3, "warmup_steps": 2,
                       "per_device_train_batch_size": 2, "seed": 11},
           "output_dir": name, "generate": None}
    path = data["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(*args, timeout=600) -> dict:
    proc = subprocess.run(CLI + ["train", *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kill_after_first_checkpoint(config: Path, ckpts: Path, timeout=300) -> int:
    "Start `train`, SIGKILL it as soon as a checkpoint is complete; return the step of that checkpoint."
    with open(config.with_suffix(".killed.log"), "w") as log:
        proc = subprocess.Popen(CLI + ["train", str(config)], stdout=log, stderr=log)
        t0 = time.monotonic()
        try:
            while not list(ckpts.glob("checkpoint-*/checkpoint_complete.json")):
                assert proc.poll() is None, f"run ended before a checkpoint (exit {proc.returncode})"
                assert time.monotonic() - t0 < timeout, "no checkpoint in time"
                time.sleep(0.002)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    return min(int(p.parent.name.split("-")[1]) for p in ckpts.glob("checkpoint-*/checkpoint_complete.json"))


def _weights(adapter) -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(adapter) / "adapter_model.safetensors"))


@pytest.mark.parametrize("layout", ["padded", "packed", "streaming"])
def test_kill_and_resume_matches_uninterrupted(data, layout):
    d = data["dir"]
    ckpts = d / f"killed_{layout}" / "checkpoints"
    step = _kill_after_first_checkpoint(_config(data, f"killed_{layout}", layout), ckpts)
    assert step < STEPS and not (d / f"killed_{layout}" / "adapter").exists()
    # killed while saving: a later checkpoint folder with some files but no completion marker
    half = ckpts / f"checkpoint-{STEPS - 1}"
    shutil.copytree(ckpts / f"checkpoint-{step}", half, dirs_exist_ok=True)
    (half / "checkpoint_complete.json").unlink()
    (half / "trainer_state.json").write_text('{"global_step": 7, "log_hi')
    resumed = _train(_config(data, f"killed_{layout}", layout), "--resume")
    assert resumed["resumed_from"] is not None and not half.exists()
    resumed_step = int(Path(resumed["resumed_from"]).name.split("-")[1])
    assert step <= resumed_step < STEPS and resumed_step % SAVE_EVERY == 0
    full = _train(_config(data, f"full_{layout}", layout))
    assert full["resumed_from"] is None and resumed["steps"] == full["steps"] == STEPS
    curves = [json.loads(Path(s["report"]).read_text())["loss_curve"] for s in (resumed, full)]
    after = [(a, b) for a, b in zip(*curves) if a[0] > resumed_step]
    assert len(after) == STEPS - resumed_step and all(a[0] == b[0] for a, b in after)
    loss_gap = max(abs(a[1] - b[1]) for a, b in after)
    w_res, w_full = _weights(resumed["adapter"]), _weights(full["adapter"])
    assert w_res.keys() == w_full.keys() and len(w_full) > 4
    weight_gap = max((w_res[k] - w_full[k]).abs().max().item() for k in w_full)
    print(f"{layout}: killed at checkpoint {step}, resumed from {resumed_step}; max |loss diff| {loss_gap:.2e}, "
          f"max |weight diff| {weight_gap:.2e}")
    assert loss_gap <= TOL and weight_gap <= TOL
    if layout != "streaming":   # the resumed run trained only on the batches after its checkpoint
        assert 0 < resumed["tokens"] < full["tokens"]


def test_resume_path_errors(data):
    from unsloth_prep.training import resume_path
    d = data["dir"]
    assert resume_path(d / "nothing_yet" / "checkpoints", "latest") is None
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        resume_path(d, str(d / "nope"))
    (d / "half" / "checkpoint-4").mkdir(parents=True)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resume_path(d / "half", str(d / "half" / "checkpoint-4"))


# the other tasks' trainers: raw data, what `prepare --config` writes from it, and the length
TASK_RUNS = {"pretrain": ("corpus.jsonl", "blocks", 64), "dpo": ("pairs.jsonl", "pairs", 128)}


def _task_config(data, name: str, task: str) -> Path:
    source, path, length = TASK_RUNS[task]
    cfg = {"task": task, "data": {"source": source, "path": path},
           "model": {"name": data["model"], "cpu_threads": 1}, "max_seq_length": length, "packing": False,
           "lora": {"r": 8, "alpha": 16},
           "trainer": {"max_steps": STEPS, "save_steps": SAVE_EVERY, "learning_rate": 5e-3, "warmup_steps": 2,
                       "per_device_train_batch_size": 2, "seed": 11, "logging_steps": 1}, "output_dir": name}
    path = data["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def task_data(data):
    "A generated corpus and preference pairs, prepared by each run's own config."
    from unsloth_prep.fixtures import write_corpus, write_pairs
    d = data["dir"]
    write_corpus(d / "corpus.jsonl", 60, seed=2)
    write_pairs(d / "pairs.jsonl", 40, seed=2)
    for task in TASK_RUNS:
        proc = subprocess.run(CLI + ["prepare", "--config", str(_task_config(data, f"{task}_killed", task))],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return data


@pytest.mark.parametrize("task", list(TASK_RUNS))
def test_task_kill_and_resume_matches_uninterrupted(task_data, task):
    """Continued pretraining and DPO killed after a checkpoint and resumed (`train --resume`): the losses after it and
    the final adapter equal an uninterrupted run's (optimizer, scheduler, RNG and data order come back)."""
    d = task_data["dir"]
    killed = _task_config(task_data, f"{task}_killed", task)
    step = _kill_after_first_checkpoint(killed, d / f"{task}_killed" / "checkpoints")
    resumed = _train(killed, "--resume")
    full = _train(_task_config(task_data, f"{task}_full", task))
    assert resumed["resumed_from"] is not None and full["resumed_from"] is None
    resumed_step = int(Path(resumed["resumed_from"]).name.split("-")[1])
    assert step <= resumed_step < STEPS and resumed["steps"] == full["steps"] == STEPS
    res, ful = ({s: x for s, x in run["loss_curve"]} for run in (resumed, full))
    assert list(ful) == list(range(1, STEPS + 1)) and len(full["losses"]) == STEPS   # the summary holds the curve
    after = [s for s in ful if s > resumed_step]
    assert all(s in res for s in after)
    loss_gap = max(abs(res[s] - ful[s]) for s in after)
    w_res, w_full = _weights(resumed["adapter"]), _weights(full["adapter"])
    assert w_res.keys() == w_full.keys() and len(w_full) > 4
    weight_gap = max((w_res[k] - w_full[k]).abs().max().item() for k in w_full)
    print(f"{task}: killed at checkpoint {step}, resumed from {resumed_step}; max |loss diff| {loss_gap:.2e}, "
          f"max |weight diff| {weight_gap:.2e}")
    assert loss_gap <= TOL and weight_gap <= TOL
