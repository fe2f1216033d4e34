"""Smoke tests in fresh processes: every exported module imports on its own, the CLI answers, notebooks keep their conventions."""
import json, os, pkgutil, subprocess, sys
from pathlib import Path

import pytest

import unsloth_prep
from clitools import last_json, read_rows, run

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(m.name for m in pkgutil.iter_modules(unsloth_prep.__path__) if not m.name.startswith("_"))


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_in_fresh_process(module):
    # catches exported code that uses names defined only in unexported notebook cells
    run(sys.executable, "-c", f"import unsloth_prep.{module}")


def test_every_command_module_exists():
    from unsloth_prep.cli import COMMANDS
    for name, (module, _) in COMMANDS.items():
        assert module.rsplit(".", 1)[1] in MODULES, f"{name} routes to missing {module}"


def test_help_lists_commands():
    out = run("unsloth-prep", "--help").stdout
    for name in ("demo", "tiny-model", "generate"): assert name in out


def test_generate_then_bad_input(tmp_path):
    ok = last_json(run("unsloth-prep", "generate", str(tmp_path / "x.jsonl"), "--n", "25", "--format", "openai"))
    assert ok["records"] == 25 and ok["peak_rss_mb"] > 0 and ok["seconds"] >= 0
    assert sum(1 for _ in open(tmp_path / "x.jsonl")) == 25
    bad = run("unsloth-prep", "generate", str(tmp_path / "y.jsonl"), check=False)
    assert bad.returncode == 2 and "error" in last_json(bad) and "give n" in bad.stderr
    unknown = run("unsloth-prep", "frobnicate", check=False)
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr


ALLOCATOR = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "ARROW_DEFAULT_MEMORY_POOL", "OPENBLAS_NUM_THREADS")


@pytest.mark.parametrize("mine", [{}, {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "4"}])
def test_data_commands_set_the_allocators_for_themselves_and_their_workers(tmp_path, mine):
    """A data command fixes glibc's mmap threshold, one arena, Arrow's system pool and one BLAS thread in its
    environment (its workers inherit it) before its work starts; a user's own settings are kept."""
    code = ("import json, os, sys\nfrom unsloth_prep.cli import main\nmain(['generate', sys.argv[1], '--n', '3'])\n"
            f"print(json.dumps({{k: os.environ.get(k) for k in {ALLOCATOR!r}}}))")
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR and k != "GLIBC_TUNABLES"}
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "g.jsonl")], capture_output=True, text=True,
                       env={**env, **mine}, check=True)
    want = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_ARENA_MAX": "1", "ARROW_DEFAULT_MEMORY_POOL": "system",
            "OPENBLAS_NUM_THREADS": "1"}
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {**want, **mine}


def test_tiny_model_command(tmp_path):
    out = last_json(run("unsloth-prep", "tiny-model", str(tmp_path / "tiny")))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(out["files"])


def notebooks():
    return sorted(p for p in (ROOT / "nbs").glob("*.ipynb"))


@pytest.mark.parametrize("nb", notebooks(), ids=lambda p: p.name)
def test_notebook_conventions(nb):
    cells = json.loads(nb.read_text())["cells"]
    assert cells[0]["cell_type"] == "markdown" and "".join(cells[0]["source"]).startswith("# "), "title first"
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    colab = next((c for c in code if "google.colab" in c), None)
    assert colab is not None and code.index(colab) <= 1, "Colab/Kaggle install cell near the top"
    assert "KAGGLE_KERNEL_RUN_TYPE" in colab and "pip install" in colab
    for c in cells:  # prose written as `# ` comments renders as a wall of headings
        lines = [l for l in "".join(c["source"]).splitlines() if l.strip()]
        if c["cell_type"] == "markdown" and len(lines) > 1:
            assert not all(l.startswith("# ") or l.strip() == "#" for l in lines), f"commented-out markdown: {lines[0][:60]}"
    size = nb.stat().st_size
    assert size < 1_500_000, f"{nb.name} is {size:,} bytes: keep figures small"


def test_prepare_routes_by_task(tmp_path):
    # the same `prepare` command reaches each task's module; an unknown task is refused with the choices (exit 2)
    from unsloth_prep.fixtures import tiny_model
    tok = tiny_model()
    (tmp_path / "t.jsonl").write_text('{"text": "one small document"}\n{"text": "and a second one"}\n')
    pre = last_json(run("unsloth-prep", "prepare", tmp_path / "t.jsonl", "--tokenizer", tok, "--out",
                        tmp_path / "b", "--task", "pretrain", "--block-size", "4"))
    assert pre["documents"] == 2 and pre["blocks"] >= 1 and pre["task"] == "pretrain"
    assert len(read_rows(tmp_path / "b")) == pre["blocks"]
    pair = '{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}], ' \
           '"rejected": [{"role": "assistant", "content": "no"}]}\n'
    (tmp_path / "p.jsonl").write_text(pair)
    dpo = last_json(run("unsloth-prep", "prepare", tmp_path / "p.jsonl", "--tokenizer", tok, "--out",
                        tmp_path / "d", "--task=dpo"))
    assert dpo["task"] == "dpo" and dpo["rows"] == 1 and set(read_rows(tmp_path / "d")[0]) >= {"chosen_ids", "rejected_ids"}
    bad = run("unsloth-prep", "prepare", tmp_path / "p.jsonl", "--task", "rlhf", check=False)
    assert bad.returncode == 2 and "invalid choice: 'rlhf'" in bad.stderr and "'pretrain'" in bad.stderr
