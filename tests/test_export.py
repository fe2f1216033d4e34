"""`unsloth-prep export`: the merged folder loads in plain transformers (peft and unsloth blocked), matches base +
adapter, carries the training chat template; GGUF without llama.cpp fails clearly and writes nothing."""
import json, os, subprocess, sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("unsloth")

# the CLI with `export` registered (the same `main` the `unsloth-prep` entry point runs)
CLI = [sys.executable, "-c", "import sys; from unsloth_prep import cli; "
       "cli.COMMANDS.setdefault('export', ('unsloth_prep.export', 'merge a LoRA run into its base model')); "
       "sys.exit(cli.main())"]
TEMPLATE = "qwen-2.5"
CONV = [{"role": "user", "content": "Why pack 序列?"}, {"role": "assistant", "content": "Less padding."},
        {"role": "user", "content": "And eval?"}]
# base + unmerged adapter, float32, in a fresh process: logits on fixed inputs and a greedy reply
REFERENCE = r'''
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, adapter, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
x = torch.tensor(ids)
with torch.no_grad():
    logits = m(input_ids=x).logits.tolist()
    new = m.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                     pad_token_id=0)[0, x.shape[1]:].tolist()
print(json.dumps({"logits": logits, "new_tokens": new}))
'''


def _cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP"}
    p = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A short training run on data prepared with a named chat template."
    from unsloth_prep.fixtures import iter_records, tiny_model
    from unsloth_prep.tokenizer import load_tokenizer
    from unsloth_prep.tokenization import prepare
    d = tmp_path_factory.mktemp("export")
    model = str(tiny_model())
    tok = load_tokenizer(model, TEMPLATE)
    prepare(iter_records(48, "openai", seed=2), tok, d / "prepared.parquet", max_seq_length=128)
    cfg = {"data": {"path": "prepared.parquet"}, "model": {"name": model, "cpu_threads": 1}, "template": TEMPLATE,
           "max_seq_length": 128, "lora": {"r": 8, "alpha": 16, "modules_to_save": ["lm_head"]},
           "trainer": {"max_steps": 6, "learning_rate": 5e-3, "per_device_train_batch_size": 4}, "output_dir": "run",
           "generate": None}
    (d / "train.yaml").write_text(yaml.safe_dump(cfg))
    code, s, err = _cli("train", d / "train.yaml")
    assert code == 0, err[-3000:]
    prompt_ids = tok.apply_chat_template(CONV[:1], add_generation_prompt=True, tokenize=True)
    return {"dir": d, "model": model, "adapter": Path(s["adapter"]), "tok": tok, "ids": [prompt_ids]}


@pytest.fixture(scope="module")
def reference(run):
    "Logits and greedy tokens of base + unmerged adapter (float32), computed once."
    p = subprocess.run([sys.executable, "-c", REFERENCE, run["model"], str(run["adapter"]), json.dumps(run["ids"])],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_merged_float32_matches_base_plus_adapter(run, reference):
    import torch
    from transformers import AutoTokenizer
    from unsloth_prep.export import load_plain
    out = run["dir"] / "merged32"
    code, s, err = _cli("export", run["dir"] / "run", "--merged", out, "--dtype", "float32", "--prompt", "hi",
                        "--max-new-tokens", 4)
    assert code == 0, err[-3000:]
    assert s["method"] == "peft" and s["check"]["loaded_without"] == ["peft", "unsloth"], s
    assert s["size_mb"] > 0 and (out / "model.safetensors").exists() and not (out / "adapter_config.json").exists()
    got, ref = load_plain(out, "Why pack 序列?", run["ids"], max_new_tokens=12), reference
    gap = (torch.tensor(got["logits"]) - torch.tensor(ref["logits"])).abs().max().item()
    assert gap < 1e-4, gap          # float32: the merge only reorders additions
    assert got["new_tokens"] == ref["new_tokens"] and got["dtype"] == "float32"
    # the exported tokenizer renders conversations byte for byte as the one `prepare` used
    exported = AutoTokenizer.from_pretrained(str(out))
    for conv in (CONV, CONV[:1]):
        for gen in (False, True):
            want = run["tok"].apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert exported.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == want


def test_merged_bfloat16_with_unsloth(run, reference):
    import torch
    from unsloth_prep.export import load_plain
    out = run["dir"] / "merged_bf16"
    code, s, err = _cli("export", run["adapter"], "--merged", out, "--dtype", "bfloat16", "--no-check")
    assert code == 0, err[-3000:]
    assert s["method"] == "unsloth" and s["dtype"] == "bfloat16" and "check" not in s, s
    got, ref = load_plain(out, input_ids=run["ids"]), reference
    assert got["dtype"] == "bfloat16"
    gap = (torch.tensor(got["logits"]) - torch.tensor(ref["logits"])).abs().max().item()
    assert gap < 0.5, gap           # bfloat16 weights: 8 mantissa bits
    code, s, err = _cli("export", run["adapter"], "--merged", out, "--dtype", "bfloat16", "--no-check")
    assert code == 2 and "already exists" in s["error"]


def test_gguf_without_llama_cpp_fails_clearly(run, tmp_path):
    out = tmp_path / "merged"
    code, s, err = _cli("export", run["dir"] / "run", "--merged", out, "--gguf", "q4_k_m", cwd=tmp_path)
    assert code == 2, (code, s)
    for needle in ("needs llama.cpp", "convert_hf_to_gguf.py", "llama-quantize", "no GGUF file was written",
                   "python llama.cpp/convert_hf_to_gguf.py"):
        assert needle in s["error"] and needle in err, needle
    assert not out.exists() and not list(tmp_path.rglob("*.gguf"))


def test_export_without_adapter(tmp_path):
    code, s, err = _cli("export", tmp_path, "--merged", tmp_path / "m")
    assert code == 2 and f"{tmp_path}: no LoRA adapter" in s["error"]
