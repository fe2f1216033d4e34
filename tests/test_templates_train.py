"""A reasoning dataset and a tool-calling dataset, prepared with Unsloth's `qwen3-thinking` and `gpt-oss` templates by
`unsloth-prep prepare` (fresh processes), checked row by row by the verifier, then trained a few steps on CPU with the
tiny model: one run per template on both datasets, in one fresh process (Unsloth imported once)."""
import json, subprocess, sys

import pytest
import yaml

pytest.importorskip("unsloth")
from clitools import last_json, read_rows, run
from unsloth_prep.fixtures import tiny_model
from unsloth_prep.loading import iter_conversations
from unsloth_prep.tokenization import verify_labels
from unsloth_prep.tokenizer import load_tokenizer

TEMPLATES = ("qwen3-thinking", "gpt-oss")


def reasoning_records(n: int = 12) -> list:
    """OpenAI records with reasoning as a `reasoning_content` field (Qwen3's datasets) or as `<think>` content."""
    out = []
    for i in range(n):
        q, a, why = f"What is {i} + {i}?", f"{2 * i}.", f"Add {i} to itself: {2 * i}."
        if i % 3 == 0: turns = [{"role": "assistant", "content": a, "reasoning_content": why}]
        elif i % 3 == 1: turns = [{"role": "assistant", "content": f"<think>\n{why}\n</think>\n\n{a}"}]
        else: turns = [{"role": "assistant", "content": a, "reasoning_content": why},
                       {"role": "user", "content": "And doubled?"},
                       {"role": "assistant", "content": f"{4 * i}.", "reasoning_content": "Twice that."}]
        out.append({"messages": [{"role": "user", "content": q}] + turns})
    return out


def tool_records(n: int = 12) -> list:
    """LLaMA-Factory ShareGPT records: `function_call` (one call, or two at once) and `observation` turns, `tools` as JSON text."""
    tools = json.dumps([{"name": "get_weather", "description": "Weather of a city",
                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])
    out = []
    for i in range(n):
        cities = ["Paris", "Rome"] if i % 4 == 3 else [["Paris", "Oslo", "Lima"][i % 3]]
        call = [{"name": "get_weather", "arguments": {"city": c}} for c in cities]
        turns = [{"from": "human", "value": f"Weather in {' and '.join(cities)}?"},
                 {"from": "function_call", "value": json.dumps(call[0] if len(call) == 1 else call)},
                 {"from": "observation", "value": json.dumps({"sky": "sunny", "c": 20 + i})},
                 {"from": "gpt", "value": f"It is sunny, {20 + i} °C."}]
        out.append({"conversations": turns, "tools": tools})
    return out


TRAIN = r'''
import json, sys
from unsloth_prep.training import train
print("__RESULT__" + json.dumps({p: {k: v for k, v in train(p).items() if k in ("steps", "first_loss", "final_loss")}
                                 for p in sys.argv[1:]}))
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    for name, recs in (("reasoning", reasoning_records()), ("tools", tool_records())):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    return d


def _config(d, outs, template):
    return {"data": {"path": [str(o) for o in outs]}, "model": {"name": str(tiny_model()), "cpu_threads": 1},
            "template": template, "max_seq_length": 512, "packing": False, "lora": {"r": 4, "alpha": 8},
            "trainer": {"max_steps": 2, "learning_rate": 5e-3, "per_device_train_batch_size": 2, "warmup_steps": 0},
            "output_dir": str(d / f"run-{template}")}


def test_prepare_and_train(data):
    configs = []
    for template in TEMPLATES:
        tok, outs = load_tokenizer(tiny_model(), template), []
        for name in ("reasoning", "tools"):
            out = data / f"{name}-{template}"                 # an output folder (the Hub's layout)
            s = last_json(run("unsloth-prep", "prepare", data / f"{name}.jsonl", "--tokenizer", tiny_model(),
                              "--template", template, "--out", out, "--max-seq-length", 512))
            assert s["rows"] == s["records"] == 12 and s["rejected"] == 0, s
            rows, convs = read_rows(out), list(iter_conversations(data / f"{name}.jsonl"))
            rep = verify_labels(rows, tok, convs, max_seq_length=512)
            assert rep.ok, (template, name, rep, rep.examples[:2])
            trained = [tok.decode([i for i, l in zip(r["input_ids"], r["labels"]) if l != -100]) for r in rows]
            if name == "reasoning": assert all("Add" in t or "Twice" in t or "<think>" in t for t in trained)
            else: assert all("get_weather" in t and "sunny" in t for t in trained)   # the call and the answer train
            outs.append(out)
        cfg = data / f"{template}.yaml"
        cfg.write_text(yaml.safe_dump(_config(data, outs, template)))
        configs.append(cfg)
    p = subprocess.run([sys.executable, "-c", TRAIN, *map(str, configs)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.rsplit("__RESULT__", 1)[1])
    assert all(r["steps"] == 2 and r["final_loss"] == r["final_loss"] for r in res.values()), res
