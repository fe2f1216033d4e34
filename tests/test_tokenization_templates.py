"""Exact labels for every listed Unsloth chat template, checked by the verifier, in one fresh process that imports Unsloth first."""
import json, subprocess, sys

import pytest

ENCODERS = ["fastokens", "tokenizers"]
TEMPLATES = ["own", "chatml", "qwen-2.5", "llama-3", "llama-3.1", "mistral", "gemma", "gemma-3", "phi-3", "phi-4"]

SCRIPT = r'''
import unsloth  # first: it patches transformers
import json, random
from transformers import AutoTokenizer
from unsloth_prep.fixtures import iter_records, tiny_model
from unsloth_prep.tokenization import TRAIN_ON, TokenizeCounts, tokenize_conversation, verify_labels, ChatRenderer
from unsloth_prep.tokenizer import apply_template
BOS = {"llama-3": "<|begin_of_text|>", "llama-3.1": "<|begin_of_text|>", "mistral": "<s>", "gemma": "<bos>", "gemma-3": "<bos>"}
recs = list(iter_records(360, "openai", seed=11, empty_rate=0.05))
data = []
for k in range(120):
    m = recs[k]["messages"]
    kind = k % 4
    if kind == 1: m = m + [x for x in recs[120 + k]["messages"] if x["role"] != "system"] + [x for x in recs[240 + k]["messages"] if x["role"] != "system"]
    if kind == 2: m = [dict(x, content="\n  " + x["content"] + " \n") for x in m]
    if kind == 3 and m[0]["role"] != "system": m = [{"role": "system", "content": "You are helpful."}] + m
    data.append({"messages": m})
from unsloth_prep.tokenizer import encoder_for
out = {}
for enc, name in [(e, n) for e in ENCODERS for n in TEMPLATES]:
    tok = AutoTokenizer.from_pretrained(tiny_model())
    if name in BOS: tok.bos_token = BOS[name]
    tok = apply_template(tok, name)
    assert encoder_for(tok, enc).name == enc
    res = {"bos": tok.bos_token, "eos": tok.eos_token}
    for mode in TRAIN_ON:
        c = TokenizeCounts()
        pairs = [(x, tokenize_conversation(x, tok, train_on=mode, counts=c)) for x in data]
        kept = [(x, r) for x, r in pairs if r is not None]
        rep = verify_labels([r for _, r in kept], tok, [x for x, _ in kept], train_on=mode, retokenize=True)
        first = kept[0][1]["input_ids"]
        res[mode] = {"rows": rep.rows, "ok_rows": rep.ok_rows, "problems": dict(rep.problems),
                     "dropped": dict(c.reasons), "multi_turn_runs": 0, "starts_with_bos": tok.bos_token_id is not None and first[0] == tok.bos_token_id,
                     "double_bos": tok.bos_token_id is not None and first[:2] == [tok.bos_token_id] * 2}
        if mode == "all-assistant":
            mt = tokenize_conversation(data[1], tok, train_on=mode)
            from unsloth_prep.tokenization import _runs
            res[mode]["multi_turn_runs"] = len(_runs(mt["labels"]))
            lt = tokenize_conversation(data[1], tok, train_on="last-assistant")
            res["last_runs"] = len(_runs(lt["labels"]))
        # truncation keeps the last answer whole and the verifier still passes
        c2 = TokenizeCounts()
        tr = [(x, tokenize_conversation(x, tok, train_on=mode, max_seq_length=256, counts=c2)) for x in data]
        tr = [(x, r) for x, r in tr if r is not None]
        rep2 = verify_labels([r for _, r in tr], tok, [x for x, _ in tr], train_on=mode, max_seq_length=256)
        res[mode].update(trunc_ok=rep2.ok, truncated=c2.truncated, trunc_max=max(len(r["input_ids"]) for _, r in tr))
    out[f"{enc}:{name}"] = res
print("__RESULT__" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def results():
    code = f"TEMPLATES = {TEMPLATES!r}\nENCODERS = {ENCODERS!r}\n" + SCRIPT
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.rsplit("__RESULT__", 1)[1])


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("name", TEMPLATES)
def test_template_exact_labels(results, name, encoder):
    r = results[f"{encoder}:{name}"]
    for mode in ("all-assistant", "last-assistant", "all"):
        m = r[mode]
        assert m["rows"] >= 110 and m["ok_rows"] == m["rows"], (mode, m)
        assert not m["double_bos"]
        assert m["trunc_ok"] and m["truncated"] > 0 and m["trunc_max"] <= 256, (mode, m)
    assert r["all-assistant"]["dropped"].get("empty_response", 0) > 0          # empty answers are never trained
    assert r["all"]["dropped"] == {}
    assert r["all-assistant"]["multi_turn_runs"] == 3 and r["last_runs"] == 1  # every turn vs the last one
    if name in ("llama-3", "llama-3.1", "mistral", "gemma", "gemma-3"):
        assert r["all-assistant"]["starts_with_bos"], "BOS written once by the template"
