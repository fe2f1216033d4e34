"""`unsloth-prep plan` in fresh processes, and the estimator/recommender properties over many inputs."""
import json, subprocess

import pytest

from unsloth_prep.oom import GPUS, KNOWN_CONFIGS, estimate, recommend, _rank


def plan(*args, check=True):
    """Run `unsloth-prep plan ...` in a fresh process; return (process, last JSON line or None)."""
    proc = subprocess.run(["unsloth-prep", "plan", *args], capture_output=True, text=True, timeout=600)
    if check: assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return proc, (json.loads(lines[-1]) if proc.returncode == 0 and lines else None)


def test_plan_builtin_name_offline():
    proc, out = plan("--model", "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", "--gpu", "T4")
    assert out["fits"] is True and 0 < out["estimated_gb"] < 14.7
    assert out["from_pretrained"]["load_in_4bit"] is True and out["sft_config"]["fp16"] is True
    assert out["get_peft_model"]["use_gradient_checkpointing"] == "unsloth"
    assert "weights" in proc.stdout and "activations" in proc.stdout


def test_plan_stats_file_and_config_folder(tmp_path):
    from unsloth_prep.fixtures import tiny_model
    stats = tmp_path / "stats.json"
    # what `unsloth-prep stats` prints: human lines, then the JSON summary last
    stats.write_text("1,000 rows: p50 300 ...\n" + json.dumps({"p50": 300, "p95": 900, "p99": 1500, "max": 3000, "suggested_max_seq_length": 960}) + "\n")
    _, out = plan("--model", str(tiny_model()), "--gpu", "24GB", "--stats", str(stats), "--lora-rank", "8")
    assert out["from_pretrained"]["max_seq_length"] == 960 and out["get_peft_model"]["r"] == 8
    assert out["sft_config"]["bf16"] is False  # size-only GPU: bf16 unknown
    # a saved stats object, pretty-printed over many lines, works as well
    stats.write_text(json.dumps({"p50": 200, "p95": 700, "p99": 900, "max": 1000, "suggested_max_seq_length": 704}, indent=2))
    _, out = plan("--model", str(tiny_model()), "--gpu", "24GB", "--stats", str(stats))
    assert out["from_pretrained"]["max_seq_length"] == 704


def test_plan_config_json_path(tmp_path):
    cfg = dict(KNOWN_CONFIGS["qwen2.5-7b"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, a = plan("--model", str(tmp_path), "--gpu", "A100-80GB")
    _, b = plan("--model", str(tmp_path / "config.json"), "--gpu", "A100-80GB")
    assert a["estimated_gb"] == b["estimated_gb"] and a["sft_config"]["bf16"] is True


def test_plan_data_with_tokenizer_uses_tokenization_stats(tmp_path):
    from unsloth_prep.fixtures import tiny_model, write_records
    data = tmp_path / "chat.jsonl"
    write_records(data, n=200, fmt="openai", seed=1)
    _, out = plan("--model", "llama-3.2-1b", "--gpu", "L4", "--data", str(data), "--tokenizer", str(tiny_model()))
    assert out["stats"]["p95"] > 0 and out["from_pretrained"]["max_seq_length"] % 64 == 0
    assert out["from_pretrained"]["max_seq_length"] == out["stats"]["suggested_max_seq_length"]
    assert {r["check"] for r in out["preflight"]} >= {"text_field", "pad_token", "trust_remote_code", "precision"}


def test_plan_preflight_config_warnings(tmp_path):
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"from_pretrained": {"max_seq_length": 2048, "trust_remote_code": True},
                               "sft_config": {"per_device_train_batch_size": 16, "bf16": True, "group_by_length": True}}))
    _, out = plan("--model", "llama-3.1-8b", "--gpu", "T4", "--config", str(cfg))
    warn = {r["check"] for r in out["preflight"] if r["status"] == "warning"}
    assert {"trust_remote_code", "precision", "per_device_batch", "group_by_length", "sft_max_length"} <= warn
    assert out["warnings"] == len(warn)


@pytest.mark.parametrize("args, needle", [
    (["--model", "llama-3.1-8b", "--gpu", "TPU"], "gpu='TPU'"),
    (["--model", "/nope/config.json", "--gpu", "T4"], "/nope/config.json"),
    (["--model", "llama-3.1-8b", "--gpu", "T4", "--stats", "/nope.json"], "/nope.json"),
])
def test_plan_bad_input_exits_2(args, needle):
    proc, _ = plan(*args, check=False)
    assert proc.returncode == 2 and needle in proc.stderr + proc.stdout


def test_plan_bad_stats_names_file_and_field(tmp_path):
    p = tmp_path / "s.json"; p.write_text('{"rows": 3}\n')
    proc, _ = plan("--model", "llama-3.1-8b", "--gpu", "T4", "--stats", str(p), check=False)
    assert proc.returncode == 2 and "s.json" in proc.stderr + proc.stdout and "p95" in proc.stderr + proc.stdout


@pytest.mark.parametrize("model", list(KNOWN_CONFIGS))
def test_recommendation_monotone_in_vram(model):
    sizes = [f"{g}GB" for g in range(6, 161, 2)]
    for stats in (None, {"p50": 100, "p95": 300}, {"p50": 2000, "p95": 7000}):
        for r in (8, 64):
            ranks = [_rank(recommend(model, s, stats=stats, lora_rank=r)) for s in sizes]
            assert ranks == sorted(ranks), (model, stats, r)
            fit = [recommend(model, s, stats=stats, lora_rank=r)["fits"] for s in sizes]
            assert fit == sorted(fit)  # once it fits, more memory keeps fitting


def test_estimate_monotone_in_every_input():
    base = dict(load="4bit", lora_rank=16, batch_size=2, seq_len=1024, checkpointing=True)
    e0 = estimate("llama-3.1-8b", **base).total_bytes
    for k, v in (("lora_rank", 64), ("batch_size", 4), ("seq_len", 4096), ("load", "16bit"), ("checkpointing", False)):
        assert estimate("llama-3.1-8b", **{**base, k: v}).total_bytes > e0, k


def test_bf16_follows_capability():
    for name, g in GPUS.items():
        r = recommend("llama-3.2-1b", name)
        assert r["sft_config"]["bf16"] == (g["capability"] >= 8.0) and r["sft_config"]["fp16"] == (not r["sft_config"]["bf16"])
