"""The main job, as a user runs it: `unsloth-prep demo` in a fresh process, offline, end to end, from a folder that
holds a clone named `unsloth_prep` (the stages import the installed package); each task writes into OUT/TASK."""
import json, math, subprocess
from pathlib import Path

from clitools import read_rows


def _beside_a_clone(folder: Path) -> Path:
    "A folder holding a directory named `unsloth_prep` with an unrelated package in it: where the demo is run from."
    (folder / "unsloth_prep").mkdir(parents=True, exist_ok=True)
    (folder / "unsloth_prep" / "__init__.py").write_text("raise ImportError('the clone, not the installed package')\n")
    return folder


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo" / "sft"
    proc = subprocess.run(["unsloth-prep", "demo", "--out", str(tmp_path / "demo"), "--records", "400"],
                          capture_output=True, text=True, timeout=900, cwd=_beside_a_clone(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["out"] == str(out) and summary["report"] == str(out / "report.json")
    report = json.loads(Path(summary["report"]).read_text())
    assert Path(summary["report"]).with_suffix(".png").stat().st_size > 5000
    assert list(summary["stages"]) == list(report["stages"])
    for name, stage in summary["stages"].items():
        assert stage["peak_rss_mb"] > 0 and stage["seconds"] >= 0, name
        assert (out / "logs" / f"{name}.log").exists()
    assert list(summary["stages"]) == ["generate", "tiny-model", "inspect", "doctor", "convert", "stats", "prepare",
                                       "plan", "train", "export"]
    assert summary["steps"] == 30 and summary["final_loss"] < 0.9 * summary["first_loss"], "loss must fall clearly"
    assert Path(summary["artefacts"]["adapter"]).exists() and Path(summary["artefacts"]["packed"]).exists()
    # the run ends as a merged model that plain transformers loaded in a fresh process and generated from
    merged = summary["merged"]
    assert merged["folder"] == summary["artefacts"]["merged"] and (Path(merged["folder"]) / "model.safetensors").exists()
    assert 0 < merged["size_mb"] and isinstance(merged["generated"], str) and merged["generated"]
    assert report["merged"] == merged and "merged model:" in proc.stdout
    assert summary["seconds"] < 300, "the demo must stay under 5 minutes on this machine"


def run_task_demo(tmp_path, task):
    "Run `unsloth-prep demo --task TASK` in a fresh process; its JSON summary, report.json and stdout."
    out = tmp_path / "demo_out" / task
    proc = subprocess.run(["unsloth-prep", "demo", "--task", task, "--out", str(out.parent)], capture_output=True,
                          text=True, timeout=600, cwd=_beside_a_clone(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["out"] == str(out) and summary["report"] == str(out / "report.json")
    report = json.loads(Path(summary["report"]).read_text())
    assert summary["task"] == report["task"] == task and list(summary["stages"]) == list(report["stages"])
    assert list(summary["stages"]) == ["generate", "tiny-model", "inspect", "doctor", "prepare", "plan", "train",
                                       "export"]
    # the doctor finds the planted problems (exit 1); every other stage succeeds
    assert {n: s["exit_code"] for n, s in summary["stages"].items()} == {
        n: 1 if n == "doctor" else 0 for n in summary["stages"]}
    for name, stage in report["stages"].items():
        assert stage["peak_rss_mb"] > 0 and (out / "logs" / f"{name}.log").exists(), name
    assert Path(summary["report"]).with_suffix(".png").stat().st_size > 5000
    # trained the requested steps (the task's default), finite losses, a merged model plain transformers loaded
    assert summary["steps"] == report["stages"]["train"]["summary"]["steps"] == 12
    assert summary["losses"] == report["losses"] and all(math.isfinite(x) for x in summary["losses"])
    assert Path(summary["artefacts"]["adapter"]).exists()
    merged = summary["merged"]
    assert (Path(merged["folder"]) / "model.safetensors").exists() and merged["size_mb"] > 0 and merged["generated"]
    return summary, report


def test_demo_dpo(tmp_path):
    summary, report = run_task_demo(tmp_path, "dpo")
    stages = report["stages"]
    planted = stages["generate"]["summary"]["defects"]
    found = {f["code"]: f["count"] for f in stages["doctor"]["summary"]["findings"]}
    # every planted pair defect is named by the doctor, with its count
    assert found["chosen_equals_rejected"] == len(planted["identical"]) > 0
    assert found["preference_empty_response"] == len(planted["empty_response"]) > 0
    assert found["response_repeats_prompt"] == len(planted["repeats_prompt"]) > 0
    prep = stages["prepare"]["summary"]
    assert prep["task"] == "dpo" and prep["rows"] > 0 and prep["rows"] + prep["dropped"] == prep["records"] == 200
    assert len(summary["losses"]) == 12 and Path(summary["artefacts"]["prepared"]).exists()
    assert stages["train"]["summary"]["batches"]["exact"], "the trainer must read the prepared token ids as they are"


def test_demo_pretrain(tmp_path):
    summary, report = run_task_demo(tmp_path, "pretrain")
    stages = report["stages"]
    gen, prep = stages["generate"]["summary"], stages["prepare"]["summary"]
    # blocks were written; the malformed line was skipped into the rejects file, not lost
    assert prep["blocks"] > 0 and prep["block_size"] == 128 and Path(summary["artefacts"]["blocks"]).exists()
    assert prep["first_rejected_lines"] == gen["malformed_lines"] and len(gen["malformed_lines"]) > 0
    assert Path(summary["artefacts"]["rejects"]).exists()
    assert summary["first_loss"] == summary["losses"][0] and summary["final_loss"] == summary["losses"][-1]
    # the report plots the logged curve, every step (not a line from the first loss to the last)
    assert report["loss_steps"] == list(range(1, 13)) and len(summary["losses"]) == 12


def test_demo_vision(tmp_path):
    "`demo --task vision`: drawn images, the tiny vision model, image tokens in the rows, a few LoRA steps."
    from unsloth_prep.tokenizer import load_tokenizer
    out = tmp_path / "demo_out" / "vision"
    proc = subprocess.run(["unsloth-prep", "demo", "--task", "vision", "--out", str(out.parent)], capture_output=True,
                          text=True, timeout=600, cwd=_beside_a_clone(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["out"] == str(out)
    report = json.loads(Path(summary["report"]).read_text())
    assert summary["task"] == report["task"] == "vision" and list(summary["stages"]) == list(report["stages"])
    assert list(summary["stages"]) == ["generate", "tiny-model", "inspect", "doctor", "prepare", "plan", "train"]
    for name, stage in report["stages"].items():
        assert stage["peak_rss_mb"] > 0 and (out / "logs" / f"{name}.log").exists(), name
    assert Path(summary["report"]).with_suffix(".png").stat().st_size > 5000
    train = report["stages"]["train"]["summary"]
    assert train["task"] == "vision" and summary["steps"] == train["steps"] == 12
    assert summary["losses"] == report["losses"] and len(summary["losses"]) == 12
    assert all(math.isfinite(x) for x in summary["losses"])
    assert (Path(summary["artefacts"]["adapter"]) / "adapter_config.json").exists() and summary["merged"] is None
    if train["backend"] == "transformers+peft":
        assert "CPU backend refuses vision models" in (out / "logs" / "train.log").read_text()
    # every prepared row holds its images' exact tokens (one pad per merged 2x2 patch block), none of them trained
    prep = report["stages"]["prepare"]["summary"]
    gen = report["stages"]["generate"]["summary"]
    assert 0 < prep["images"] <= gen["images"] and prep["rows"] + prep["dropped"] + prep["rejected"] == gen["records"]
    pad = load_tokenizer(summary["artefacts"]["model"]).convert_tokens_to_ids("<|image_pad|>")
    rows = read_rows(summary["artefacts"]["prepared"])  # prepare's output folder (the Hub's layout)
    assert len(rows) == prep["rows"] > 0
    for r in rows:
        where = [i for i, t in enumerate(r["input_ids"]) if t == pad]
        assert len(where) == sum(t * h * w // 4 for t, h, w in r["image_grid_thw"]) > 0
        assert all(r["labels"][i] == -100 for i in where) and any(x != -100 for x in r["labels"])
    assert sum(len(r["images"]) for r in rows) == prep["images"]
    assert sum(r["input_ids"].count(pad) for r in rows) == prep["image_tokens"]
