"""Benchmark: our preference preparation vs TRL's own DPOTrainer dataset preparation, same pairs, ids compared.

  python tests/bench/bench_preference.py [--small] [--n N]

Both start from the same N conversational pairs (prompt with system + user turns, one assistant answer each; a fifth
of the prompts multi-turn; Chinese and English) and the tiny model's tokenizer folder (its own ChatML template):
- TRL: `Dataset.from_list(pairs)` then `DPOTrainer._prepare_dataset` (trl's tokenization with the transformers
  tokenizer: three chat-template renders and three tokenizations per pair, in `datasets.map`);
- ours: `prepare_preference(pairs, tok, out.parquet)` (lean tokenizer, one prompt render, batched Rust encoding,
  written to Parquet).
Target: ours >= 1.5x faster. Ids: the prompt ids must be identical; each answer must be identical up to our end-of-turn
token, and every token TRL has beyond it is shown (ChatML writes a newline after `<|im_end|>`; TRL trains it, we stop at
the end-of-turn token as the SFT labels do). Prints a table and a JSON line; timings are wall-clock on whatever machine
runs it (a shared machine makes them indicative).
"""
import argparse, json, sys, tempfile, time
from collections import Counter
from pathlib import Path


def make_pairs(n):
    from unsloth_prep.fixtures import iter_records
    recs = list(iter_records(2 * n, "openai", seed=3))
    out = []
    for k in range(n):
        m = recs[k]["messages"]
        prompt = [x for x in m if x["role"] != "assistant"]
        if k % 5 == 1:
            prompt = prompt + [{"role": "assistant", "content": "好的。"}, {"role": "user", "content": "More?"}]
        out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": m[-1]["content"]}],
                    "rejected": [{"role": "assistant", "content": recs[n + k]["messages"][-1]["content"]}]})
    return out


def trl_prepare(pairs, path):
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(path)
    args = DPOConfig(output_dir=tempfile.mkdtemp(), max_length=None, report_to=[], use_cpu=True, bf16=False)
    t0 = time.perf_counter()
    ds = datasets.Dataset.from_list(pairs)
    out = DPOTrainer._prepare_dataset(DPOTrainer.__new__(DPOTrainer), ds, tok, args, "train")
    return time.perf_counter() - t0, out, tok


def ours_prepare(pairs, path, out):
    from unsloth_prep.preference import prepare_preference
    from unsloth_prep.tokenizer import load_tokenizer
    t0 = time.perf_counter()
    s = prepare_preference(pairs, load_tokenizer(path), out)
    return time.perf_counter() - t0, s


def compare(trl_ds, ours_path, tok):
    """Prompt identity and, per answer, identity up to our end-of-turn token; what TRL has beyond it."""
    import pyarrow.parquet as pq
    ours = pq.read_table(ours_path).to_pylist()
    prompt_same, answers_same, extra = 0, 0, Counter()
    for t, o in zip(trl_ds, ours):
        prompt_same += t["prompt_ids"] == o["prompt_ids"]
        for k in ("chosen_ids", "rejected_ids"):
            n = len(o[k])
            answers_same += t[k][:n] == o[k]
            extra[repr(tok.decode(t[k][n:]))] += 1
    return {"rows": len(ours), "prompt_identical": prompt_same, "answers_identical_to_end_of_turn": answers_same,
            "trl_tokens_after_end_of_turn": dict(extra)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="1,000 pairs")
    ap.add_argument("--n", type=int, default=10_000)
    a = ap.parse_args()
    n = 1000 if a.small else a.n
    import unsloth_prep.preference  # noqa: F401  (imports done before timing)
    import trl, transformers  # noqa: F401
    from unsloth_prep.fixtures import tiny_model
    path, pairs = tiny_model(), make_pairs(n)
    out = Path(tempfile.mkdtemp()) / "ours.parquet"
    ours_prepare(pairs[:50], path, out)  # warm-up: compiled template, loaded tokenizer files
    t_ours, s = ours_prepare(pairs, path, out)
    t_trl, trl_ds, tok = trl_prepare(pairs, path)
    ids = compare(trl_ds, out, tok)
    res = {"pairs": n, "trl_s": round(t_trl, 2), "ours_s": round(t_ours, 2), "speedup": round(t_trl / t_ours, 2),
           "target": 1.5, "ok": t_trl / t_ours >= 1.5 and ids["prompt_identical"] == n
           and ids["answers_identical_to_end_of_turn"] == 2 * n, **ids, "ours_rows": s["rows"]}
    print(f"{'':28}{'seconds':>10}{'pairs/s':>10}")
    print(f"{'TRL DPOTrainer._prepare_dataset':28}{t_trl:10.2f}{n / t_trl:10.0f}")
    print(f"{'ours prepare_preference':28}{t_ours:10.2f}{n / t_ours:10.0f}")
    print(f"speedup {res['speedup']}x (target 1.5x); prompts identical {ids['prompt_identical']}/{n}; answers "
          f"identical through the end-of-turn token {ids['answers_identical_to_end_of_turn']}/{2 * n}; "
          f"TRL's extra tokens after it: {ids['trl_tokens_after_end_of_turn']}")
    print(json.dumps(res, ensure_ascii=False))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
