"""The main job, as a user runs it: `unsloth-prep demo` in a fresh process, offline, end to end."""
import json, subprocess
from pathlib import Path


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(["unsloth-prep", "demo", "--out", str(out), "--records", "400"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
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
