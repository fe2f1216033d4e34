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
    assert out["codes"] == [] and out["errors"] == out["warnings"] == 0  # the tiny tokenizer and clean data: no finding


def test_plan_config_checks(tmp_path):
    # the training YAML read by the one reader; model and GPU from the config; each problem one finding
    cfg = tmp_path / "train.yaml"
    cfg.write_text("data: {path: d.parquet}\nmodel: {name: llama-3.1-8b, gpu: T4, trust_remote_code: true, dtype: bfloat16}\n"
                   "max_seq_length: 2048\ntrainer: {per_device_train_batch_size: 16}\n")
    _, out = plan("--config", str(cfg))
    assert out["model"] == "llama-3.1-8b" and out["gpu"] == "T4" and out["from_pretrained"]["max_seq_length"] == 2048
    assert out["codes"] == ["bf16_unsupported", "config_does_not_fit", "trust_remote_code"]
    assert (out["errors"], out["warnings"]) == (2, 1)
    cfg.write_text("data: {path: d.parquet}\nmodel: {name: llama-3.1-8b, gpu: T4}\nmax_seq_length: 2048\n"
                   "trainer: {per_device_train_batch_size: 1}\n")
    assert plan("--config", str(cfg))[1]["codes"] == []
    cfg.write_text("data: {path: d.parquet}\nmodel: {name: llama-3.1-8b}\nmax_seq_length: 2048\nlora: {rank: 8}\n")
    proc, _ = plan("--config", str(cfg), "--gpu", "T4", check=False)
    assert proc.returncode == 2 and "did you mean 'lora.r'" in proc.stderr and "train.yaml" in proc.stderr


def test_plan_rejects_rules_that_are_not_rules(tmp_path):
    # a batch of 8 that fits the GPU is not a finding (no "per-device batch <= 2" rule)
    cfg = tmp_path / "train.yaml"
    cfg.write_text("data: {path: d.parquet}\nmodel: {name: llama-3.2-1b, gpu: A100-80GB}\nmax_seq_length: 1024\n"
                   "trainer: {per_device_train_batch_size: 8}\n")
    assert plan("--config", str(cfg))[1]["codes"] == []


def test_scan_data_percentiles_match_numpy(tmp_path):
    import numpy as np
    from unsloth_prep.oom import scan_data, _length_stats
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 3000, 137)
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"input_ids": [1] * int(n), "labels": [1] * int(n)}) + "\n" for n in lengths))
    st = _length_stats(scan_data(p)["lengths"])
    for q in (50, 95, 99):
        assert st[f"p{q}"] == int(np.percentile(lengths, q, method="higher")) >= np.percentile(lengths, q)
    assert st["suggested_max_seq_length"] == int(np.ceil(st["p95"] / 64) * 64)


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
