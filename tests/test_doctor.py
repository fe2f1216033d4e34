"""`doctor`: each planted problem is reported (code, count, line numbers) on a crafted file; clean generated data gives
no finding; the CLI runs in a fresh process with exit status 0 (clean) / 1 (errors) / 2 (bad input)."""
import json, subprocess, sys
from pathlib import Path

import pytest

from unsloth_prep.doctor import doctor, write_clean, fix_pad_token, open_tokenizer
from unsloth_prep.fixtures import iter_records, tiny_model, write_records, CHATML_TEMPLATE


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows: f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def tok(tiny):
    return open_tokenizer(tiny)


@pytest.fixture(scope="module")
def variant(tiny, tmp_path_factory):
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("tok")
    def make(name, change):
        t = AutoTokenizer.from_pretrained(str(tiny)); change(t); t.save_pretrained(root / name)
        return root / name
    return make


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """One alpaca file with every raw-data problem planted at known lines."""
    recs = [json.dumps(r, ensure_ascii=False) for r in iter_records(60, seed=31)]
    lines = list(recs)
    lines[4] = json.dumps({**json.loads(recs[4]), "output": "   "})         # line 5: whitespace answer
    lines[9] = json.dumps({**json.loads(recs[9]), "output": ""})            # line 10: empty answer
    lines[14] = recs[2]                                                      # line 15: duplicate of line 3
    lines[19] = json.dumps({"instruction": "x", "response": "y"})           # line 20: misnamed field
    lines[24] = '{"instruction": "unterminated'                              # line 25: malformed
    lines[29] = "null"                                                       # line 30: malformed
    lines[34] = json.dumps({"instruction": "x", "output": ["not", "text"]})  # line 35: invalid type
    path = tmp_path_factory.mktemp("crafted") / "crafted.jsonl"
    return write_jsonl(path, lines)


@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt", "openai"])
def test_clean_generated_data_has_no_findings(tmp_path, tok, fmt):
    path = tmp_path / f"clean_{fmt}.jsonl"
    write_records(path, n=300, fmt=fmt, seed=41)
    rep = doctor(path, tokenizer=tok)
    assert rep.codes == [] and rep.errors == rep.warnings == 0, rep.text()
    assert rep.checked == 300 and rep.info["format"] == fmt


def test_clean_json_array_and_gzip(tmp_path, tok):
    write_records(tmp_path / "a.json", n=100, layout="json_array", seed=42)
    write_records(tmp_path / "b.jsonl.gz", n=100, gzip=True, seed=43)
    for p in ("a.json", "b.jsonl.gz"):
        rep = doctor(tmp_path / p, tokenizer=tok)
        assert rep.codes == [] and rep.checked == 100, rep.text()


def test_clean_data_with_a_generous_max_seq_length(tmp_path, tok):
    write_records(tmp_path / "c.jsonl", n=200, seed=44)
    lengths = doctor(tmp_path / "c.jsonl", tokenizer=tok).info["lengths"]
    rep = doctor(tmp_path / "c.jsonl", tokenizer=tok, max_seq_length=lengths["max"])
    assert rep.codes == [], rep.text()


def test_crafted_raw_problems_are_all_reported(crafted):
    rep = doctor(crafted)
    f = rep.findings
    assert set(rep.codes) == {"empty_response", "duplicate", "missing_field", "malformed_line", "invalid_record"}, rep.text()
    assert f["empty_response"].count == 2 and f["empty_response"].examples == [5, 10]
    assert f["duplicate"].count == 1 and f["duplicate"].examples == [15]
    assert f["missing_field"].count == 1 and f["missing_field"].examples == [20]
    assert "response" in f["missing_field"].fix
    assert f["malformed_line"].count == 2 and f["malformed_line"].examples == [25, 30]
    assert f["invalid_record"].examples == [35]
    assert rep.checked == 58
    out = rep.as_dict()
    assert out["errors"] == 4 and out["warnings"] == 1 and out["codes"] == rep.codes


def test_write_clean_fixes_every_raw_problem(crafted, tmp_path):
    counts = write_clean(crafted, tmp_path / "clean.jsonl")
    assert counts["written"] == 60 - 7
    assert (counts["malformed_line"], counts["duplicate"], counts["empty_response"], counts["missing_field"], counts["invalid_record"]) == (2, 1, 2, 1, 1)
    assert doctor(tmp_path / "clean.jsonl").codes == []


def test_misnamed_columns_get_a_mapping_that_works(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": r["instruction"], "answer": r["output"]} for r in iter_records(50, seed=1)])
    with open(path) as f: first = json.loads(f.readline())
    with pytest.raises(KeyError): first["instruction"]
    rep = doctor(path)
    assert rep.codes == ["missing_field"] and rep.findings["missing_field"].count == 50
    fix = rep.findings["missing_field"].fix
    assert '"instruction": "question"' in fix and '"output": "answer"' in fix
    assert doctor(path, fmt="alpaca", mapping={"instruction": "question", "output": "answer"}).codes == []


def test_no_assistant_turn_is_untrainable(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}] + list(iter_records(10, fmt="openai", seed=2))
    rep = doctor(write_jsonl(tmp_path / "u.jsonl", rows))
    assert rep.codes == ["no_trainable_tokens"] and rep.findings["no_trainable_tokens"].examples == [1]


def test_truncated_and_dropped_at_max_seq_length(tmp_path, tok):
    write_records(tmp_path / "long.jsonl", n=200, seed=45)
    rep = doctor(tmp_path / "long.jsonl", tokenizer=tok, max_seq_length=128)
    assert {"truncated", "dropped_too_long"} <= set(rep.codes) and rep.errors == 0
    best = rep.info["lengths"]["suggested_max_seq_length"]
    assert f"max_seq_length={best}" in rep.findings["truncated"].fix
    rep2 = doctor(tmp_path / "long.jsonl", tokenizer=tok, max_seq_length=best)
    over = sum(f.count for f in rep2.findings.values())
    assert over <= 0.06 * 200  # at the suggested length only the tail past p95 is left


def test_tokenizer_problems(tmp_path, variant):
    write_records(tmp_path / "d.jsonl", n=30, seed=46)
    data = tmp_path / "d.jsonl"
    assert doctor(data, tokenizer=variant("no_pad", lambda t: setattr(t, "pad_token", None))).codes == ["no_pad_token"]
    assert doctor(data, tokenizer=variant("pad_eos", lambda t: setattr(t, "pad_token", t.eos_token))).codes == ["pad_is_eos"]
    assert doctor(data, tokenizer=variant("no_tpl", lambda t: setattr(t, "chat_template", None))).codes == ["no_chat_template"]
    other = CHATML_TEMPLATE.replace("<|im_start|>", "<|turn_start|>").replace("<|im_end|>", "<|turn_end|>")
    rep = doctor(data, tokenizer=variant("other_tpl", lambda t: setattr(t, "chat_template", other)))
    assert {"template_token_missing", "eos_not_end_of_turn"} <= set(rep.codes)   # the split marker is trained in pieces
    assert "no_end_of_turn" not in rep.codes and rep.info["template_family"] == "custom"
    assert rep.findings["template_token_missing"].examples == ["<|turn_end|>", "<|turn_start|>"]
    plain = ("{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n### Response:\n"
             "{% elif m['role'] == 'assistant' %}{{ m['content'] }}\n\n{% endif %}{% endfor %}")
    rep = doctor(data, tokenizer=variant("plain_tpl", lambda t: setattr(t, "chat_template", plain)))
    assert rep.codes == ["eos_not_end_of_turn", "no_end_of_turn"] and rep.findings["no_end_of_turn"].count == 30


def test_fix_pad_token(tiny):
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(str(tiny)); t.pad_token = t.eos_token
    fix_pad_token(t)
    assert t.pad_token_id is not None and t.pad_token_id != t.eos_token_id


def _tokenized_rows(tok, n=30):
    from unsloth_prep.tokenization import tokenize_conversation
    from unsloth_prep.loading import normalize_record
    return [tokenize_conversation(normalize_record(r, "alpaca"), tok) for r in iter_records(n, seed=47)]


def test_tokenized_rows_problems(tmp_path, tok):
    rows = _tokenized_rows(tok)
    assert doctor(write_jsonl(tmp_path / "ok.jsonl", rows), tokenizer=tok).codes == []
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    bad = [dict(r) for r in rows]
    bad[2]["labels"] = bad[2]["labels"][:-1]                                   # line 3: length mismatch
    bad[5]["labels"] = list(bad[5]["input_ids"])                               # line 6: prompt trained
    bad[8]["labels"] = [-100] * len(bad[8]["input_ids"])                       # line 9: nothing trained
    lab = list(bad[11]["labels"]); j = max(k for k, x in enumerate(lab) if x != -100)
    assert bad[11]["input_ids"][j] == im_end
    lab[j] = -100; bad[11]["labels"] = lab                                     # line 12: end of turn not trained
    rep = doctor(write_jsonl(tmp_path / "bad.jsonl", bad), tokenizer=tok)
    f = rep.findings
    assert set(rep.codes) == {"length_mismatch", "prompt_trained", "no_trainable_tokens", "no_end_of_turn"}, rep.text()
    assert f["length_mismatch"].examples == [3] and f["prompt_trained"].examples == [6]
    assert f["no_trainable_tokens"].examples == [9] and f["no_end_of_turn"].examples == [12]
    assert doctor(tmp_path / "bad.jsonl").codes == ["length_mismatch"]   # without a tokenizer: lengths only


def test_doubled_bos_in_tokenized_rows(tmp_path, tok):
    rows = _tokenized_rows(tok, 10)
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    rows[4] = {"input_ids": [bos, bos] + rows[4]["input_ids"], "labels": [-100, -100] + rows[4]["labels"]}
    tok2 = open_tokenizer(tiny_model()); tok2.bos_token = "<|begin_of_text|>"
    rep = doctor(write_jsonl(tmp_path / "bos.jsonl", rows), tokenizer=tok2)
    assert rep.codes == ["doubled_bos"] and rep.findings["doubled_bos"].examples == [5] and rep.errors == 1


def test_sample_reads_only_the_first_records(tmp_path):
    write_records(tmp_path / "s.jsonl", n=500, seed=48)
    rep = doctor(tmp_path / "s.jsonl", sample=40)
    assert rep.checked == 40 and rep.info["sampled"]


def test_config_that_does_not_fit_the_gpu(tmp_path):
    pytest.importorskip("unsloth_prep.oom")
    big = {"model": {"name": "llama-3.1-8b", "gpu": "T4", "load_in_4bit": False}, "max_seq_length": 8192,
           "trainer": {"per_device_train_batch_size": 8}, "data": {"path": "x"}}
    small = {"model": {"name": "llama-3.2-1b", "gpu": "A100-80GB"}, "max_seq_length": 1024,
             "trainer": {"per_device_train_batch_size": 1}, "data": {"path": "x"}}
    write_records(tmp_path / "d.jsonl", n=20, seed=49)
    rep = doctor(tmp_path / "d.jsonl", config=big)
    assert rep.codes == ["config_does_not_fit"] and "trainer.per_device_train_batch_size: 2" in rep.findings["config_does_not_fit"].fix
    assert doctor(tmp_path / "d.jsonl", config=small).codes == []


def run_cli(*args):
    proc = subprocess.run(["unsloth-prep", "doctor", *map(str, args)], capture_output=True, text=True, timeout=600)
    if proc.returncode not in (0, 1, 2) or not proc.stdout.strip(): raise AssertionError(proc.stderr[-3000:])
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_exit_codes_in_fresh_processes(tmp_path, tiny, crafted):
    write_records(tmp_path / "clean.jsonl", n=100, seed=50)
    proc, out = run_cli(tmp_path / "clean.jsonl", "--tokenizer", tiny, "--max-seq-length", "8192")
    assert proc.returncode == 0 and out["errors"] == 0 and out["codes"] == [] and out["checked"] == 100
    assert "exit_code" not in out and out["command"] == "doctor"
    proc, out = run_cli(crafted, "--sample", "1000")
    assert proc.returncode == 1 and out["errors"] == 4 and "malformed_line" in out["codes"]
    assert "ERROR" in proc.stdout and "fix:" in proc.stdout
    proc, out = run_cli(crafted, "--write-clean", tmp_path / "fixed.jsonl")
    assert proc.returncode == 1 and out["clean"]["written"] == 53
    proc, out = run_cli(tmp_path / "fixed.jsonl")
    assert proc.returncode == 0 and out["codes"] == []
    proc, out = run_cli(tmp_path / "missing.jsonl")
    assert proc.returncode == 2 and "missing.jsonl" in out["error"]


def test_prepared_and_packed_parquet_have_no_findings(tmp_path, tok):
    from unsloth_prep.tokenization import prepare
    from unsloth_prep.collators import pack_parquet
    write_records(tmp_path / "p.jsonl", n=150, seed=51)
    prepare(tmp_path / "p.jsonl", tok, tmp_path / "p.parquet", max_seq_length=512)
    pack_parquet(tmp_path / "p.parquet", tmp_path / "packed.parquet", 1024)
    for name, L in (("p.parquet", 512), ("packed.parquet", 1024)):
        rep = doctor(tmp_path / name, tokenizer=tok, max_seq_length=L)
        assert rep.codes == [] and rep.info["format"] == "tokenized" and rep.checked > 0, rep.text()


def test_empty_and_all_malformed_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    rep = doctor(tmp_path / "empty.jsonl")
    assert rep.codes == ["no_records"] and rep.errors == 1
    write_jsonl(tmp_path / "bad.jsonl", ["null", "{oops", "[1, 2]"])
    rep = doctor(tmp_path / "bad.jsonl")
    assert rep.codes == ["malformed_line"] and rep.findings["malformed_line"].examples == [1, 2, 3]


def test_folder_of_files_names_file_and_line(tmp_path):
    write_records(tmp_path / "d" / "a.jsonl", n=20, seed=60)
    write_jsonl(tmp_path / "d" / "b.jsonl", list(iter_records(5, seed=61)) + ["{broken"])
    rep = doctor(tmp_path / "d")
    assert rep.codes == ["malformed_line"] and rep.findings["malformed_line"].examples == ["b.jsonl:6"] and rep.checked == 25


def test_huge_records_are_named(tmp_path):
    # records over HUGE_CHARS are what gets a `map(num_proc=N)` worker OOM-killed; doctor names their lines
    path = tmp_path / "huge.jsonl"
    write_records(path, n=120, fmt="sharegpt", huge_every=40, seed=3)
    rep = doctor(path)
    assert rep.codes == ["huge_record"] and rep.findings["huge_record"].count == 3
    assert rep.findings["huge_record"].examples == [40, 80, 120] and not rep.errors


def test_bos_written_by_the_template_is_information_not_a_warning(tmp_path, variant):
    # a Llama-3-style tokenizer: encoding adds BOS and the template renders it too. On clean data doctor states the
    # fact (info) and warns nothing; the rows prepare writes start with exactly one BOS, and doctor finds none doubled.
    from tokenizers.processors import TemplateProcessing
    from unsloth_prep.tokenization import prepare
    import pyarrow.parquet as pq
    def llama3_like(t):
        bos = "<|begin_of_text|>"
        t._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                         special_tokens=[(bos, t.convert_tokens_to_ids(bos))])
        t.bos_token = bos
        t.chat_template = "{{ bos_token }}" + CHATML_TEMPLATE
    path = variant("llama3_like", llama3_like)
    tok = open_tokenizer(path)
    assert tok(tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False))["input_ids"][:2] == [tok.bos_token_id] * 2
    write_records(tmp_path / "clean.jsonl", n=40, seed=52)
    rep = doctor(tmp_path / "clean.jsonl", tokenizer=tok)
    assert rep.codes == ["bos_in_template"] and rep.errors == rep.warnings == 0, rep.text()
    prepare(tmp_path / "clean.jsonl", tok, tmp_path / "p.parquet", max_seq_length=1024)
    rows = pq.read_table(tmp_path / "p.parquet").to_pylist()
    assert rows and all(r["input_ids"][0] == tok.bos_token_id != r["input_ids"][1] for r in rows)
    rep = doctor(tmp_path / "p.parquet", tokenizer=tok)
    assert "doubled_bos" not in rep.codes and rep.errors == rep.warnings == 0, rep.text()
