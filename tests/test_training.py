"Training: the `unsloth-prep train` command in a fresh process, config errors, streaming and pre-packed data."
import json, math, os, shutil, subprocess, sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("unsloth")


def _run_cli(*args, timeout=600):
    "Run `unsloth-prep ...` in a fresh process; return (exit code, last JSON line as dict, stderr)."
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    exe = shutil.which("unsloth-prep")
    cmd = [exe] if exe else [sys.executable, "-c", "import sys; from unsloth_prep.cli import main; sys.exit(main())"]
    p = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no JSON line; stdout tail: {p.stdout[-2000:]}\nstderr tail: {p.stderr[-2000:]}"
    return p.returncode, json.loads(lines[-1]), p.stderr


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    "A small prepared Parquet (and its packed twin) from generated conversations and the tiny model's tokenizer."
    from unsloth_prep.collators import pack_parquet
    from unsloth_prep.fixtures import iter_records, tiny_model
    from unsloth_prep.tokenizer import load_tokenizer
    from unsloth_prep.tokenization import prepare
    d = tmp_path_factory.mktemp("train")
    model = str(tiny_model())
    s = prepare(iter_records(96, "openai", seed=3), load_tokenizer(model), d / "prepared.parquet", max_seq_length=256)
    pack_parquet(d / "prepared.parquet", d / "packed.parquet", 256)
    return {"dir": d, "model": model, "parquet": Path(s["out"]), "packed": d / "packed.parquet"}


def _config(prepared, **kw):
    cfg = {"data": {"path": "prepared.parquet"}, "model": {"name": prepared["model"], "cpu_threads": 1},
           "max_seq_length": 256, "packing": False, "lora": {"r": 8, "alpha": 16, "modules_to_save": ["lm_head"]},
           "trainer": {"max_steps": 4, "learning_rate": 5e-3, "per_device_train_batch_size": 2, "warmup_steps": 0},
           "output_dir": "run", "generate": {"prompt": "hello", "max_new_tokens": 4}}
    for k, v in kw.items(): cfg[k] = v
    return cfg


def test_cli_train(prepared):
    d = prepared["dir"]
    cfg = _config(prepared)
    cfg["data"]["eval_path"] = "packed.parquet"     # evaluated every 3 steps, in the training (packed) layout
    (d / "train.yaml").write_text(yaml.safe_dump(cfg))
    code, s, err = _run_cli("train", d / "train.yaml", "--set", "trainer.max_steps=6", "--set", "packing=true",
                            "--set", "trainer.eval_steps=3")
    assert code == 0, err[-3000:]
    for k in ("first_loss", "final_loss", "steps", "seconds", "tokens_per_s", "report", "peak_rss_mb", "adapter"):
        assert k in s, k
    assert s["steps"] == 6 and s["packed"] is True and s["tokens_per_s"] > 0 and s["peak_rss_mb"] > 100
    assert s["final_loss"] < s["first_loss"]
    report = json.loads(Path(s["report"]).read_text())
    assert Path(s["report"]).parent == d / "run" and Path(s["report_png"]).exists()
    assert len(report["loss_curve"]) == 6 and report["tokens"] > 0 and isinstance(s["generated"], str)
    assert [st for st, _ in report["eval_curve"]] == [3, 6] and s["final_eval_loss"] == report["eval_curve"][-1][1]
    assert report["eval_data"].endswith("packed.parquet") and s["resumed_from"] is None
    assert (Path(s["adapter"]) / "adapter_config.json").exists() and (Path(s["adapter"]) / "tokenizer.json").exists()


@pytest.mark.parametrize("bad, needle", [
    ({"lora": {"rank": 8}}, ("unknown key 'lora.rank'", "did you mean 'lora.r'?")),
    ({"model": {"cpu_threads": 1}}, ("missing required key 'model.name'",)),
    ({"trainer": {"max_step": 3}}, ("unknown key 'trainer.max_step' (not an SFTConfig argument)", "did you mean 'trainer.max_steps'?")),
    ({"data": {"path": "nope/*.parquet"}}, ("nope/*.parquet: no prepared Parquet file found",)),
])
def test_cli_config_errors(prepared, bad, needle):
    d = prepared["dir"]
    cfg = _config(prepared)
    for k, v in bad.items(): cfg[k] = v
    (d / "bad.yaml").write_text(yaml.safe_dump(cfg))
    code, s, err = _run_cli("train", d / "bad.yaml", timeout=300)
    assert code == 2, (code, s)
    assert str(d / "bad.yaml") in s["error"] or "nope" in s["error"], s
    assert all(n in s["error"] and n in err for n in needle), (s, err[-2000:])
    if "data" in bad:   # found before the training stack is imported (about 950 MB once it is)
        assert s["peak_rss_mb"] < 500, s


def test_streaming_and_prepacked(prepared):
    import unsloth  # noqa: F401  (before transformers/trl)
    from unsloth_prep.training import load_config, train
    d = prepared["dir"]
    # streaming: an IterableDataset, packed on the fly, length unknown -> max_steps drives the run
    cfg = load_config(_config(prepared, data={"path": str(prepared["parquet"]), "streaming": True}, packing=True,
                              output_dir=str(d / "stream"), generate=None))
    s = train(cfg)
    assert s["steps"] == 4 and s["packed"] is True and s["tokens"] > 0
    with pytest.raises(ValueError, match="streaming data needs 'trainer.max_steps' > 0"):
        train(load_config(_config(prepared, data={"path": str(prepared["parquet"]), "streaming": True},
                                  trainer={"max_steps": -1, "num_train_epochs": 1}, output_dir=str(d / "x"))))
    # rows already packed by `collators.pack_parquet` are detected (packing: false in the config)
    # ... and a named Unsloth chat template is applied to the tokenizer saved with the adapter
    s2 = train(load_config(_config(prepared, data={"path": str(prepared["packed"])}, output_dir=str(d / "prepacked"),
                                   template="chatml", generate=None)))
    assert s2["packed"] is True and s2["steps"] == 4
    saved = json.loads((Path(s2["adapter"]) / "tokenizer_config.json").read_text())
    tmpl = saved.get("chat_template") or (Path(s2["adapter"]) / "chat_template.jinja").read_text()
    assert "<|im_start|>" in tmpl


def test_early_stopping_on_eval_loss(prepared):
    import unsloth  # noqa: F401  (before transformers/trl)
    from unsloth_prep.training import load_config, train
    d = prepared["dir"]
    # an improvement of 100 in eval loss is never reached: the run stops after `patience` evals without one
    cfg = load_config(_config(prepared, data={"path": str(prepared["parquet"]), "eval_path": str(prepared["parquet"])},
                              early_stopping={"patience": 1, "threshold": 100.0}, output_dir=str(d / "early"),
                              generate=None, trainer={"max_steps": 12, "eval_steps": 2, "learning_rate": 1e-3,
                                                      "per_device_train_batch_size": 2}))
    s = train(cfg)
    report = json.loads(Path(s["report"]).read_text())
    assert s["steps"] < 12 and s["steps"] == report["eval_curve"][-1][0] and len(report["eval_curve"]) <= 2
    with pytest.raises(ValueError, match="'early_stopping.patience' needs eval rows"):
        train(load_config(_config(prepared, data={"path": str(prepared["parquet"])}, early_stopping={"patience": 1},
                                  output_dir=str(d / "x2"))))


def test_cli_train_image_rows(tmp_path):
    "Rows prepared with a processor folder train through the vision trainer: losses, adapter, report; no text path."
    from unsloth_prep.fixtures import tiny_model, tiny_vision_model, write_vision_records
    from unsloth_prep.vision import prepare_vision
    model = tiny_vision_model()
    info = write_vision_records(tmp_path / "vis", n=8, seed=2)
    prep = prepare_vision(info["path"], model, tmp_path / "vis.parquet", max_seq_length=256)
    assert prep["rows"] > 0 and prep["image_tokens"] > 0
    cfg = {"data": {"path": "vis.parquet"}, "model": {"name": str(model), "cpu_threads": 1}, "max_seq_length": 256,
           "lora": {"r": 8, "alpha": 16}, "output_dir": "run",
           "trainer": {"max_steps": 3, "learning_rate": 1e-2, "per_device_train_batch_size": 2}}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    code, s, err = _run_cli("train", tmp_path / "train.yaml", "--set", "packing=true")
    assert code == 0, err[-3000:]
    assert s["task"] == "vision" and s["steps"] == 3 and len(s["losses"]) == 3 and s["rows"] == prep["rows"]
    assert all(math.isfinite(x) for x in s["losses"]) and s["first_loss"] == s["losses"][0]
    assert Path(s["adapter"]).parent == tmp_path / "run" and (Path(s["adapter"]) / "adapter_config.json").exists()
    report = json.loads(Path(s["report"]).read_text())
    assert [st for st, _ in report["loss_curve"]] == [1, 2, 3] and Path(s["report_png"]).stat().st_size > 0
    assert "does not use: packing" in err    # a config key the image trainer ignores is named, not dropped quietly
    if s["backend"] == "transformers+peft":
        assert s["device"] == "cpu" and "CPU backend refuses vision models" in err
    else:
        assert s["backend"] == "unsloth.FastVisionModel"
    # the rows name their processor: a text model in the config stops before anything loads (exit 2, no traceback)
    cfg["model"]["name"] = str(tiny_model())
    (tmp_path / "text.yaml").write_text(yaml.safe_dump(cfg))
    code, s, err = _run_cli("train", tmp_path / "text.yaml", timeout=300)
    assert code == 2 and "was prepared with tokenizer" in s["error"] and "Traceback" not in err, (s, err[-2000:])


def test_cli_train_evaluates_the_validation_split(prepared, tmp_path):
    "`prepare --eval-size` writes the validation split; `train` on that folder evaluates it every eval_steps."
    from unsloth_prep.fixtures import write_records
    write_records(tmp_path / "raw.jsonl", n=80, fmt="openai", seed=4)
    code, p, err = _run_cli("prepare", tmp_path / "raw.jsonl", "--tokenizer", prepared["model"], "--out",
                            tmp_path / "prepared", "--max-seq-length", 256, "--eval-size", 16, "--no-progress")
    assert code == 0 and p["splits"]["validation"] > 0, err[-2000:]
    cfg = _config(prepared, data={"path": str(tmp_path / "prepared")}, output_dir=str(tmp_path / "run"), generate=None)
    cfg["trainer"]["eval_steps"] = 2
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    code, s, err = _run_cli("train", tmp_path / "train.yaml")
    assert code == 0, err[-3000:]
    report = json.loads(Path(s["report"]).read_text())
    assert [st for st, _ in report["eval_curve"]] == [2, 4] and math.isfinite(s["final_eval_loss"])
