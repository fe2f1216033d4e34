"""The README's "Use the prepared data in your own notebook" code, run as a user copies it: data prepared by
`unsloth_prep.api.prepare` with the template and length the code names, the tiny model in place of the Hub model,
two training steps on the CPU in a fresh process (unsloth imported first); the labels of every batch the trainer
builds are the prepared labels, padded with -100."""
import json, re, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Use the prepared data in your own notebook"

# Runs the README code with what a test machine has instead of a GPU and the Hub: the tiny model for any model name,
# full precision, two steps; every batch the collator builds is recorded.
DRIVER = r'''
import unsloth  # noqa: F401  (before transformers / trl)
import json, sys
import torch, trl
from unsloth import FastLanguageModel
from unsloth_prep.api import prepare
from unsloth_prep.collators import PaddingCollator
from unsloth_prep.fixtures import tiny_model, write_records

code, settings = open(sys.argv[1]).read(), json.loads(sys.argv[2])
write_records("chat.jsonl", n=24, fmt="openai", seed=3)
prepared = prepare("chat.jsonl", str(tiny_model()), settings["out"], template=settings["template"],
                   max_seq_length=settings["max_seq_length"])

load = FastLanguageModel.from_pretrained
def from_pretrained(model_name, **kw):
    "The tiny model whatever the name, in float32 (a CPU has no 4-bit kernels)."
    return load(str(tiny_model()), **{**kw, "load_in_4bit": False, "dtype": torch.float32})
FastLanguageModel.from_pretrained = from_pretrained

config = trl.SFTConfig
def short(**kw):
    "The README's SFTConfig, two steps, nothing saved."
    return config(**{**kw, "max_steps": 2, "save_strategy": "no", "logging_steps": 1, "bf16": False, "fp16": False})
trl.SFTConfig = short

batches, collate = [], PaddingCollator.__call__
def recording(self, features):
    out = collate(self, features)
    batches.append({k: v.tolist() for k, v in out.items()})
    return out
PaddingCollator.__call__ = recording

scope = {"__name__": "__main__"}
exec(compile(code, "README.md", "exec"), scope)
rows = [{k: r[k] for k in ("input_ids", "labels")} for r in prepared]
print(json.dumps({"rows": rows, "batches": batches, "steps": scope["trainer"].state.global_step,
                  "skip": scope["trainer"].args.dataset_kwargs}))
'''


def readme_section(text: str) -> str:
    "The python code block of the README's hand-off section."
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, re.S)
    assert len(blocks) == 1, f"expected one python block in {SECTION!r}, found {len(blocks)}"
    return blocks[0]


@pytest.fixture
def readme_code(tmp_path):
    "The README block in a file, and the settings it names (the template and length to prepare with)."
    code = readme_section((ROOT / "README.md").read_text(encoding="utf-8"))
    template = re.search(r'chat_template="([^"]+)"', code).group(1)
    length = int(re.search(r"^max_seq_length = (\d+)", code, re.M).group(1))
    out = re.search(r'load_prepared\("([^"]+)"\)', code).group(1)   # relative: prepared in the run's folder
    (tmp_path / "readme.py").write_text(code)
    return tmp_path / "readme.py", {"template": template, "max_seq_length": length, "out": out}


def test_readme_section_names_the_settings(readme_code):
    code = readme_code[0].read_text()
    for needed in ('"skip_prepare_dataset": True', "remove_unused_columns=False", "max_length=max_seq_length",
                   "packing=False", "PaddingCollator.from_tokenizer", "get_chat_template"):
        assert needed in code, needed
    assert code.index("import unsloth") < code.index("from trl import")


def test_readme_handoff_trains_on_prepared_labels(readme_code, tmp_path):
    path, settings = readme_code
    (tmp_path / "driver.py").write_text(DRIVER)
    proc = subprocess.run([sys.executable, "driver.py", str(path), json.dumps(settings)], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == 2 and out["skip"] == {"skip_prepare_dataset": True}
    prepared = {tuple(r["input_ids"]): r["labels"] for r in out["rows"]}
    seen = 0
    for b in out["batches"]:
        for ids, labels, mask in zip(b["input_ids"], b["labels"], b["attention_mask"]):
            real = [i for i, m in enumerate(mask) if m]          # the row's tokens, whichever side the padding is
            row = tuple(ids[i] for i in real)
            assert row in prepared, "a batch row that is not a prepared row"
            assert [labels[i] for i in real] == prepared[row]
            assert all(labels[i] == -100 for i, m in enumerate(mask) if not m)
            seen += 1
    assert seen >= 4 and any(l != -100 for b in out["batches"] for row in b["labels"] for l in row)
