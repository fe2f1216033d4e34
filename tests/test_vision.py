"""Images in conversations: LLaMA-Factory mllm records and OpenAI typed parts prepare with a Qwen2-VL processor,
image tokens equal the processor's grid and are masked, answers train exactly, bad image data is named, the collator
feeds Qwen2-VL's forward and a tiny Qwen2-VL trains on CPU."""
import base64, json, math, random, subprocess, sys
from pathlib import Path

import pyarrow as pa, pyarrow.parquet as pq
import pytest

from unsloth_prep.fixtures import processor_folder, tiny_vision_model, write_vision_records
from unsloth_prep.loading import Rejects
from unsloth_prep.tokenization import verify_labels
from unsloth_prep.vision import (ImageSpec, VisionCollator, VisionCounts, VisionTokenizer, check_vision, image_spec,
                                 is_processor_folder, prepare_vision, record_images, resolve_image, vision_messages,
                                 vision_stats)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("vision")
    return {"dir": d, "proc": processor_folder(d / "qwen2-vl"),
            "mllm": write_vision_records(d / "mllm", 10, size=(90, 70), multi_rate=0.3, seed=1),
            "openai": write_vision_records(d / "openai", 6, size=(120, 50), fmt="openai", multi_rate=0.5, seed=2)}


def hf_grids(proc, paths):
    from PIL import Image
    from transformers import AutoImageProcessor
    hf = AutoImageProcessor.from_pretrained(str(proc))
    return [hf(images=[Image.open(p).convert("RGB")], return_tensors="np")["image_grid_thw"][0].tolist() for p in paths]


def check_rows(out, data_json, proc, convs_from):
    """Every row: image tokens = the processor's grid for its images, all vision tokens masked, answers exact."""
    vt = VisionTokenizer(proc)
    rows = pq.read_table(out).to_pylist()
    recs = json.loads(Path(data_json).read_text())
    base = Path(data_json).parent
    assert len(rows) == len(recs)
    for row, rec in zip(rows, recs):
        refs = record_images(rec)
        want = hf_grids(proc, [base / r for r in refs])
        assert row["image_grid_thw"] == want
        assert row["input_ids"].count(vt.pad_id) == sum(g[0] * g[1] * g[2] // 4 for g in want)
        assert row["input_ids"].count(vt.tokenizer.convert_tokens_to_ids(vt.start)) == len(refs)
        assert all(l == -100 for t, l in zip(row["input_ids"], row["labels"]) if t in vt.vision_ids)
        assert [Path(s["path"]) for s in row["images"]] == [(base / r).absolute() for r in refs]
    convs = [convs_from(vt, rec, base) for rec in recs]
    rep = verify_labels(rows, vt.tokenizer, convs)
    assert rep.ok, rep
    return rows


def test_llamafactory_mllm_records_prepare(work):
    d = work["mllm"]
    s = prepare_vision(d["path"], work["proc"], work["dir"] / "mllm.parquet")
    assert (s["records"], s["rows"], s["rejected"], s["dropped"], s["images"]) == (10, 10, 0, 0, d["images"])
    rows = check_rows(s["out"], d["path"], work["proc"], lambda vt, r, b: vt.record(r, "r", b)[0])
    assert s["image_tokens"] == sum(g[1] * g[2] // 4 for r in rows for g in r["image_grid_thw"])
    assert s["trainable_tokens"] == sum(sum(l != -100 for l in r["labels"]) for r in rows)


def test_openai_typed_parts_prepare(work):
    d = work["openai"]
    recs = json.loads(Path(d["path"]).read_text())
    assert all(isinstance(r["messages"][0]["content"], list) for r in recs)
    s = prepare_vision(d["path"], work["proc"], work["dir"] / "openai.parquet")  # through the readers
    assert (s["rows"], s["rejected"], s["images"]) == (6, 0, d["images"])
    check_rows(s["out"], d["path"], work["proc"], lambda vt, r, b: vt.record(r, "r", b)[0])
    s2 = prepare_vision(recs, work["proc"], work["dir"] / "openai2.parquet", media_dir=Path(d["path"]).parent)
    assert pq.read_table(s2["out"]).column("input_ids").to_pylist() == \
        pq.read_table(s["out"]).column("input_ids").to_pylist()


def test_grid_rule_matches_the_processor(work):
    from PIL import Image
    from transformers import AutoImageProcessor
    for mx in (28 * 28 * 64, 28 * 28 * 1280):
        proc = processor_folder(work["dir"] / f"p{mx}", max_pixels=mx)
        hf, spec = AutoImageProcessor.from_pretrained(str(proc)), image_spec(proc)
        rng = random.Random(mx)
        for w, h in [(28, 28), (29, 1000), (5000, 40), (1, 1), (57, 83)] + [(rng.randint(1, 2000), rng.randint(30, 2000))
                                                                            for _ in range(15)]:
            if max(w, h) / min(w, h) > 200: continue
            got = hf(images=[Image.new("RGB", (w, h))], return_tensors="np")["image_grid_thw"][0].tolist()
            assert got == list(spec.grid(w, h)), (mx, w, h)


def test_mismatch_is_rejected_with_its_reason(work):
    recs = json.loads(Path(work["mllm"]["path"]).read_text())
    base = Path(work["mllm"]["path"]).parent
    bad = [{**recs[0], "images": recs[0]["images"] * 2}, recs[1], {**recs[2], "images": []}]
    rej = Rejects()
    s = prepare_vision(bad, work["proc"], work["dir"] / "mm.parquet", media_dir=base, rejects=rej)
    assert (s["records"], s["rows"], s["rejected"]) == (1, 1, 2)
    assert [i["line"] for i in rej.items] == [0, 2]
    assert "2 images but 1 <image> placeholders" in rej.items[0]["error"]
    assert "0 images but" in rej.items[1]["error"]
    f = work["dir"] / "mm.json"  # through the readers: rejected there, counted here
    f.write_text(json.dumps(bad))
    s = prepare_vision(f, work["proc"], work["dir"] / "mm2.parquet", media_dir=base)
    assert (s["rows"], s["rejected"]) == (1, 2)


def test_missing_corrupt_and_remote_images_are_named(work):
    recs = json.loads(Path(work["mllm"]["path"]).read_text())
    base = Path(work["mllm"]["path"]).parent
    (work["dir"] / "corrupt.jpg").write_bytes(b"\xff\xd8 not really")
    bad = [{**recs[0], "images": ["images/nope.jpg"]}, {**recs[0], "images": [str(work["dir"] / "corrupt.jpg")]},
           {**recs[0], "images": ["https://example.com/a.jpg"]}, {**recs[0], "images": ["data:image/png;base64,%%"]}]
    rej = Rejects()
    s = prepare_vision(bad, work["proc"], work["dir"] / "bad.parquet", media_dir=base, rejects=rej)
    assert (s["rows"], s["rejected"]) == (0, 4)
    errs = [i["error"] for i in rej.items]
    assert "row 0: image 'images/nope.jpg': no such file" in errs[0] and str(base / "images/nope.jpg") in errs[0]
    assert "corrupt.jpg" in errs[1] and "not a readable image" in errs[1]
    assert "needs the network" in errs[2] and "invalid base64" in errs[3]
    with pytest.raises(ValueError, match="nope.jpg"):
        VisionTokenizer(work["proc"])(bad[:1], VisionCounts(), 0, base)  # without rejects: raises


def test_embedded_images_and_hf_structs(work):
    recs = json.loads(Path(work["mllm"]["path"]).read_text())
    base = Path(work["mllm"]["path"]).parent
    raw = (base / recs[0]["images"][0]).read_bytes()
    uri = "data:image/jpeg;base64," + base64.b64encode(raw).decode()
    a = {**recs[0], "images": [{"bytes": raw, "path": "x.jpg"}]}
    b = {**recs[0], "images": [uri]}
    assert resolve_image(a["images"][0]) == raw == resolve_image(uri)
    s = prepare_vision([a, b, recs[0]], work["proc"], work["dir"] / "emb.parquet", media_dir=base)
    rows = pq.read_table(s["out"]).to_pylist()
    assert s["rows"] == 3 and rows[0]["input_ids"] == rows[1]["input_ids"] == rows[2]["input_ids"]
    assert rows[0]["images"][0]["bytes"] == raw and rows[2]["images"][0]["bytes"] is None
    batch = VisionCollator(work["proc"])(rows)
    third = batch["pixel_values"].shape[0] // 3
    assert (batch["pixel_values"][:third] == batch["pixel_values"][2 * third:]).all()
    hf = work["dir"] / "hf_image.parquet"  # a Parquet file with a Hugging Face Image column, through the readers
    pq.write_table(pa.table({"messages": [recs[0]["messages"]], "images": [[{"bytes": raw, "path": "a.jpg"}]]}), hf)
    s = prepare_vision(hf, work["proc"], work["dir"] / "hf.parquet")
    assert (s["rows"], s["rejected"]) == (1, 0)
    assert pq.read_table(s["out"]).column("input_ids").to_pylist()[0] == rows[2]["input_ids"]


def test_truncation_never_cuts_an_image(work):
    recs = json.loads(Path(work["mllm"]["path"]).read_text())
    base = Path(work["mllm"]["path"]).parent
    one = {"messages": [{"role": "user", "content": "<image>" + "word " * 300},
                        {"role": "assistant", "content": "A short answer."}], "images": recs[0]["images"][:1]}
    text = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "Fine."}]}
    s = prepare_vision([one, text], work["proc"], work["dir"] / "trunc.parquet", max_seq_length=128, media_dir=base)
    assert (s["rows"], s["truncated"], s["dropped_reasons"]) == (1, 1, {"image_truncated": 1})
    assert s["images"] == 0 and pq.read_table(s["out"]).column("images").to_pylist() == [[]]
    s = prepare_vision([one], work["proc"], work["dir"] / "t2.parquet", max_seq_length=128, on_overflow="drop",
                       media_dir=base)
    assert s["dropped_reasons"] == {"too_long": 1}


def test_train_on_all_still_masks_image_tokens(work):
    vt = VisionTokenizer(work["proc"], train_on="all")
    recs = json.loads(Path(work["mllm"]["path"]).read_text())
    cols = vt(recs[:3], VisionCounts(), 0, Path(work["mllm"]["path"]).parent)
    for ids, labels in zip(cols["input_ids"], cols["labels"]):
        assert all((l == -100) == (t in vt.vision_ids) for t, l in zip(ids, labels))


def test_text_only_tokenizer_is_no_processor(work, tmp_path):
    from unsloth_prep.fixtures import tiny_model
    text_tok = tiny_model()
    assert is_processor_folder(work["proc"]) and not is_processor_folder(text_tok)
    assert record_images(json.loads(Path(work["mllm"]["path"]).read_text())[0])  # what the lead refuses on
    with pytest.raises(ValueError, match="not a processor folder"):
        prepare_vision(work["mllm"]["path"], text_tok, tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()


def test_lengths_count_image_tokens(work):
    s = vision_stats(work["mllm"]["path"], work["proc"])
    rows = pq.read_table(prepare_vision(work["mllm"]["path"], work["proc"], work["dir"] / "st.parquet")["out"])
    lens = sorted(len(x) for x in rows.column("input_ids").to_pylist())
    assert s["max"] == lens[-1] and s["tokens"] == sum(lens)
    assert s["image_tokens"] > 0 and 0 < s["image_token_share"] < 1


def test_collator_layout(work):
    d = work["mllm"]
    out = prepare_vision(d["path"], work["proc"], work["dir"] / "col.parquet")["out"]
    rows = pq.read_table(out).to_pylist()
    col = VisionCollator(work["proc"])
    b = col(rows[:4])
    patches = sum(g[1] * g[2] for r in rows[:4] for g in r["image_grid_thw"])
    assert tuple(b["pixel_values"].shape) == (patches, 1176)
    assert b["image_grid_thw"].tolist() == [g for r in rows[:4] for g in r["image_grid_thw"]]
    assert int(b["mm_token_type_ids"].sum()) == patches // 4
    assert (b["labels"][b["attention_mask"] == 0] == -100).all()
    for i, r in enumerate(rows[:4]):
        assert b["input_ids"][i, :len(r["input_ids"])].tolist() == r["input_ids"]
    assert "pixel_values" not in col([{**rows[0], "images": [], "image_grid_thw": []}])
    other = processor_folder(work["dir"] / "small", max_pixels=28 * 28 * 4)  # bounds changed after prepare
    with pytest.raises(ValueError, match="different grid"):
        VisionCollator(other)(rows[:1])


def test_checks_find_image_problems(work, tmp_path):
    from PIL import Image
    recs = json.loads(Path(work["mllm"]["path"]).read_text())
    Image.new("RGB", (2000, 1500)).save(tmp_path / "huge.png")
    bad = [{**recs[0], "images": ["gone.jpg"]}, {**recs[0], "images": ["huge.png"]}, {**recs[0], "images": []}]
    codes = {f.code: f for f in check_vision(bad, work["proc"], tmp_path)}
    assert set(codes) == {"image_missing", "image_too_large", "image_placeholder_mismatch"}
    assert "gone.jpg" in codes["image_missing"].detail and codes["image_missing"].severity == "error"
    assert check_vision(work["mllm"]["path"], work["proc"]) == []
    textual = processor_folder(tmp_path / "noslot")
    (textual / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert [f.code for f in check_vision(work["mllm"]["path"], textual)] == ["no_image_slot"]


def test_prepare_path_is_torch_free(work, tmp_path):
    code = (f"import sys\nfrom unsloth_prep.vision import prepare_vision\n"
            f"s = prepare_vision({work['mllm']['path']!r}, {str(work['proc'])!r}, {str(tmp_path / 'o.parquet')!r})\n"
            "print(s['rows'], 'torch' in sys.modules, 'transformers' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["10", "False", "False"]


def test_tiny_qwen2_vl_trains_on_cpu(work, tmp_path):
    tiny = tiny_vision_model(tmp_path / "tiny-vl")
    prepare_vision(work["mllm"]["path"], tiny, tmp_path / "tiny.parquet")
    code = ("import json\nfrom unsloth_prep.vision import train_vision\n"
            f"r = train_vision({str(tmp_path / 'tiny.parquet')!r}, {str(tiny)!r}, {str(tmp_path / 'run')!r}, max_steps=3)\n"
            "print('RESULT' + json.dumps(r))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.rsplit("RESULT", 1)[1])
    assert r["steps"] == 3 and len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    if r["backend"] == "transformers+peft":
        assert "CPU backend refuses vision models" in p.stderr


def test_prepare_command_with_a_processor_folder(work, tmp_path):
    from clitools import last_json, read_rows, run
    from unsloth_prep.fixtures import tiny_model
    data = run("unsloth-prep", "generate", tmp_path / "vis", "--n", "7", "--format", "vision", "--seed", "3")
    assert last_json(data)["records"] == 7
    src = tmp_path / "vis" / "vision.json"
    one = last_json(run("unsloth-prep", "prepare", src, "--tokenizer", work["proc"], "--out", tmp_path / "a"))
    two = last_json(run("unsloth-prep", "prepare", src, "--tokenizer", work["proc"], "--out", tmp_path / "b",
                        "--workers", "2", "--shards", "3"))
    assert (one["rows"], one["images"]) == (7, last_json(data)["images"]) and one["image_tokens"] > 0
    assert {k: two[k] for k in ("rows", "images", "image_tokens", "tokens")} == \
        {k: one[k] for k in ("rows", "images", "image_tokens", "tokens")}
    rows = read_rows(tmp_path / "a")
    assert len(rows) == 7 and rows == read_rows(tmp_path / "b")
    bad = run("unsloth-prep", "prepare", src, "--tokenizer", tiny_model(), "--out", tmp_path / "c", check=False)
    assert bad.returncode == 2 and "images" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "c").exists()
