"""Packed rows through Unsloth on this CPU machine, in a fresh process that imports unsloth first: the logits of every
example inside a packed row equal those of the example alone for each PackedCollator mode, and Unsloth's SFTTrainer
trains on a packed dataset with PackedCollator in both the padding-free and the 4D-mask mode."""
import json, subprocess, sys

SCRIPT = r'''
import unsloth  # noqa: F401  (before transformers / trl)
import json, tempfile
import numpy as np, pyarrow as pa, torch, datasets
from unsloth import FastLanguageModel
from trl import SFTConfig, SFTTrainer
from unsloth_prep.collators import PackedCollator, pack_dataset, pack_table
from unsloth_prep.fixtures import tiny_model

model, tok = FastLanguageModel.from_pretrained(str(tiny_model()), max_seq_length=512, load_in_4bit=False, dtype=torch.float32)
rng = np.random.default_rng(0)
rows = []
for n in (33, 58, 17, 71):
    ids = rng.integers(10, 3000, n).tolist()
    rows.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
packed = pack_table(pa.Table.from_pylist(rows), 512)[0].to_pylist()
seqs = packed[0]["seq_lengths"]
out = {"rows": len(packed)}
model.eval()
with torch.no_grad():
    alone = {tuple(r["input_ids"]): model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0].float() for r in rows}
    def err(logits):
        s, e = 0, 0.0
        for n in seqs:
            e = max(e, (logits[0, s:s + n].float() - alone[tuple(packed[0]["input_ids"][s:s + n])]).abs().max().item()); s += n
        return e
    for mode in ("padding_free", "position_ids", "mask4d"):
        out[mode] = err(model(**PackedCollator(pad_token_id=tok.pad_token_id, mode=mode)(packed), use_cache=False).logits)
    ids = torch.tensor([packed[0]["input_ids"]])
    out["all-ones mask"] = err(model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits)
model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
train = pack_dataset(datasets.Dataset.from_list(rows * 8), 256)
args = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, padding_free=True,
                 max_length=None, report_to=[], logging_steps=1, save_strategy="no", bf16=False, fp16=False)
trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
out["default_collator"] = {"padding_free": bool(getattr(trainer.data_collator, "padding_free", False)),
                           "keys": sorted(trainer.data_collator([train[0], train[1]]))}
for mode in ("padding_free", "mask4d"):
    args.padding_free = False
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                         data_collator=PackedCollator.from_tokenizer(tok, mode=mode))
    out[f"keys_{mode}"] = sorted(trainer.data_collator([train[0], train[1]]))
    out[f"train_loss_{mode}"] = trainer.train().training_loss
print(json.dumps(out))
'''


def test_unsloth_packed_rows_fresh_process(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    assert out["rows"] == 1
    for mode in ("padding_free", "position_ids", "mask4d"):
        assert out[mode] < 1e-4, (mode, out[mode])
    assert out["all-ones mask"] > 1e-2
    assert "attention_mask" not in out["keys_padding_free"] and "position_ids" in out["keys_padding_free"]
    assert "attention_mask" in out["keys_mask4d"]
    for mode in ("padding_free", "mask4d"):
        assert 0 < out[f"train_loss_{mode}"] < 20
