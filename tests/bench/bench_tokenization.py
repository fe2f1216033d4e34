"""Benchmark of unsloth_prep.tokenization (issue 5).

  python tests/bench/bench_tokenization.py [--small] [--n N] [--trl-n N] [--stream-n N1,N2] [--skip-trl] [--skip-stream]

1. throughput on N generated conversations (default 100k): our render + tokenize + mask vs the raw batched fast
   tokenizer (`tokenizer(texts)`, and the Rust `encode_batch`) on the same rendered texts (target >= 0.8x);
2. TRL's own dataset preparation (`SFTTrainer._prepare_dataset`) with `assistant_only_loss` (ChatML template with
   `{% generation %}` markers, rendering the same text) and with `completion_only_loss` (prompt/completion form),
   vs our `tokenize_dataset` on the same `Dataset` (target >= 1.5x faster, identical trainable tokens where both apply);
3. peak RSS of `prepare` streaming 100k vs 1M conversations to Parquet, each in a fresh process (target within 25%).
Prints a table and a JSON line. Timings are wall-clock on whatever machine runs it.
"""
import argparse, json, os, sys, tempfile, time
from pathlib import Path

CHATML_GEN = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
              "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
              "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def best(fn, k=2):
    """Best wall time of k runs and the last result (the previous result is released before each run)."""
    ts, out = [], None
    for _ in range(k):
        out = None
        t0 = time.perf_counter(); out = fn(); ts.append(time.perf_counter() - t0)
    return min(ts), out


def throughput(n):
    """Ours vs the raw batched tokenizer on the same rendered texts."""
    from unsloth_prep.fixtures import iter_records, tiny_model
    from unsloth_prep.tokenization import ChatRenderer, ChatTokenizer, load_tokenizer
    tok = load_tokenizer(tiny_model())
    recs = list(iter_records(n, "openai", seed=0))
    ct = ChatTokenizer(tok)
    rend = ChatRenderer(tok)
    t_render, texts = best(lambda: [rend.render(r["messages"]) for r in recs], 1)
    bs = 1000
    chunks = lambda xs: (xs[i:i + bs] for i in range(0, len(xs), bs))
    # each batch's output is consumed (counted) and released, as in a streaming pipeline
    t_hf, _ = best(lambda: sum(len(x) for c in chunks(texts) for x in tok(c, add_special_tokens=False)["input_ids"]))
    t_rust, _ = best(lambda: sum(len(e.ids) for c in chunks(texts) for e in ct.backend.encode_batch(c, add_special_tokens=False)))
    t_ours, tokens = best(lambda: sum(len(x) for c in chunks(recs) for x in ct(c)["input_ids"]))
    t_spans, _ = best(lambda: [rend.spans(r["messages"]) for r in recs], 1)
    res = {"n": n, "tokens": tokens, "render_s": round(t_render, 2), "render_spans_s": round(t_spans, 2),
           "raw_hf_s": round(t_hf, 2), "raw_rust_s": round(t_rust, 2), "ours_s": round(t_ours, 2),
           "ours_conv_per_s": round(n / t_ours), "raw_hf_conv_per_s": round(n / t_hf), "raw_rust_conv_per_s": round(n / t_rust),
           "ratio_vs_raw_hf": round(t_hf / t_ours, 3), "ratio_vs_raw_rust": round(t_rust / t_ours, 3),
           "ratio_tokmask_vs_raw_hf": round(t_hf / max(1e-9, t_ours - t_spans), 3)}
    return res


def trl_compare(n):
    """TRL's _prepare_dataset (assistant_only_loss, completion_only_loss) vs our tokenize_dataset on the same Dataset."""
    import logging
    from datasets import Dataset, disable_progress_bars
    disable_progress_bars()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    from unsloth_prep.fixtures import iter_records, tiny_model
    from unsloth_prep.tokenization import tokenize_dataset
    logging.getLogger("trl").setLevel(logging.ERROR)
    path = tiny_model()
    tok = AutoTokenizer.from_pretrained(path); tok.chat_template = CHATML_GEN
    model = AutoModelForCausalLM.from_pretrained(path)
    recs = [r for r in iter_records(n, "openai", seed=1) if r["messages"][-1]["content"].strip()]
    msgs_ds = Dataset.from_list([{"messages": r["messages"]} for r in recs])
    pc_ds = Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in recs])
    out = {"n": len(recs)}
    for mode, ds in (("assistant_only_loss", msgs_ds), ("completion_only_loss", pc_ds)):
        args = SFTConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, max_length=None, dataset_num_proc=None,
                         assistant_only_loss=mode == "assistant_only_loss",
                         completion_only_loss=True if mode == "completion_only_loss" else None)
        trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=ds.select(range(8)), args=args)
        t0 = time.perf_counter()
        trl_ds = trainer._prepare_dataset(ds, tok, args, packing=False, formatting_func=None, dataset_name="bench")
        t_trl = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = tokenize_dataset(msgs_ds, tok, batch_size=1000)
        t_ours = time.perf_counter() - t0
        tl, ol = trl_ds["labels"], ours["labels"]
        same_ids = sum(a == b for a, b in zip(trl_ds["input_ids"], ours["input_ids"]))
        same_labels = sum(a == b for a, b in zip(tl, ol))
        trl_train = sum(sum(x != -100 for x in l) for l in tl); our_train = sum(sum(x != -100 for x in l) for l in ol)
        ex = next(((a, b) for a, b in zip(tl, ol) if a != b), None)
        diff = None
        if ex is not None:
            extra = [i for i, (x, y) in enumerate(zip(*ex)) if (x != -100) != (y != -100)]
            diff = tok.decode([ex[0][i] if ex[0][i] != -100 else ex[1][i] for i in extra[:5]])
        out[mode] = {"trl_s": round(t_trl, 2), "ours_s": round(t_ours, 2), "speedup": round(t_trl / t_ours, 2),
                     "rows_same_input_ids": same_ids, "rows_same_labels": same_labels,
                     "trl_trainable": trl_train, "ours_trainable": our_train, "first_difference_tokens": diff}
    return out


STREAM_CODE = """
import os, tempfile
from unsloth_prep.fixtures import iter_records, tiny_model
from unsloth_prep.tokenization import load_tokenizer, prepare
tok = load_tokenizer(tiny_model())
out = os.path.join(tempfile.mkdtemp(dir={dir!r}), "x.parquet")
result = prepare(iter_records({n}, "openai", seed=2), tok, out, max_seq_length=2048)
result["parquet_mb"] = round(os.path.getsize(out) / 2**20, 1)
os.remove(out)
"""


def stream_rss(ns, workdir):
    """Peak RSS of `prepare` streaming n conversations to Parquet, each n in a fresh interpreter."""
    from unsloth_prep.memory import run_code
    res = {}
    for n in ns:
        r = run_code(STREAM_CODE.format(n=n, dir=str(workdir)), label=f"{n:,}")
        res[n] = {"peak_mb": round(r.peak_mb, 1), "seconds": round(r.seconds, 1), "rows": r.value["rows"],
                  "parquet_mb": r.value["parquet_mb"]}
        print(f"  stream {n:>9,}: peak {r.peak_mb:7.1f} MB  {r.seconds:7.1f} s  rows {r.value['rows']:,}", flush=True)
    lo, hi = res[ns[0]]["peak_mb"], res[ns[-1]]["peak_mb"]
    return {"runs": res, "growth": round(hi / lo - 1, 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="quick run: 5k conversations, TRL on 2k, streaming 5k vs 50k")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--trl-n", type=int, default=None)
    p.add_argument("--stream-n", default=None, help="comma-separated counts, e.g. 100000,1000000")
    p.add_argument("--skip-trl", action="store_true"); p.add_argument("--skip-stream", action="store_true")
    p.add_argument("--workdir", default=tempfile.gettempdir())
    a = p.parse_args(argv)
    n = a.n or (5_000 if a.small else 100_000)
    trl_n = a.trl_n or (2_000 if a.small else 100_000)
    stream_ns = [int(x) for x in (a.stream_n or ("5000,50000" if a.small else "100000,1000000")).split(",")]
    res = {"machine": f"{os.cpu_count()} CPUs", "note": "wall-clock on a shared, busy machine"}
    print(f"throughput on {n:,} conversations ...", flush=True)
    res["throughput"] = th = throughput(n)
    print(f"{'':34s}{'seconds':>10s}{'conv/s':>10s}")
    print(f"{'raw tokenizer(texts) batched':34s}{th['raw_hf_s']:>10}{th['raw_hf_conv_per_s']:>10,}")
    print(f"{'raw Rust encode_batch':34s}{th['raw_rust_s']:>10}{th['raw_rust_conv_per_s']:>10,}")
    print(f"{'ours: render + tokenize + mask':34s}{th['ours_s']:>10}{th['ours_conv_per_s']:>10,}")
    print(f"  (render + spans alone {th['render_spans_s']} s)  ours / raw tokenizer = {th['ratio_vs_raw_hf']}x "
          f"(target >= 0.8), / Rust = {th['ratio_vs_raw_rust']}x; tokenize+mask without rendering = {th['ratio_tokmask_vs_raw_hf']}x", flush=True)
    if not a.skip_trl:
        print(f"TRL comparison on {trl_n:,} conversations ...", flush=True)
        res["trl"] = tr = trl_compare(trl_n)
        for mode in ("assistant_only_loss", "completion_only_loss"):
            m = tr[mode]
            print(f"  TRL {mode:22s} {m['trl_s']:8} s   ours {m['ours_s']:8} s   speed-up {m['speedup']}x (target >= 1.5)  "
                  f"same input_ids {m['rows_same_input_ids']}/{tr['n']}  same labels {m['rows_same_labels']}/{tr['n']}  "
                  f"trainable TRL {m['trl_trainable']:,} ours {m['ours_trainable']:,}  first diff {m['first_difference_tokens']!r}", flush=True)
    if not a.skip_stream:
        print(f"streaming prepare, peak RSS at {stream_ns} conversations ...", flush=True)
        res["stream"] = st = stream_rss(stream_ns, a.workdir)
        print(f"  peak RSS growth {stream_ns[0]:,} -> {stream_ns[-1]:,}: {st['growth']:+.1%} (target within 25%)")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
