"""Benchmark: feeding the same generated images to training three ways, peak RSS in fresh processes; and what a
prepared row costs when it stores image references vs the processed pixels.

  python tests/bench/bench_vision.py [--small] [--n N] [--json OUT]

Memory (each in a fresh process, `memory.isolated`, peak RSS read from outside), all over the same N records of
448x336 JPEG images (drawn shapes with grain, so they compress like photos) and the same Qwen2-VL processor
(max_pixels 200,704: 192 image tokens per image). The baseline of each is its RSS once torch, transformers and the
processor are loaded (the same for all three), so "over baseline" is what the feeding itself holds:
- ours: `prepare_vision` wrote references + grids to Parquet; `VisionCollator` decodes one batch of 8 at a time;
- list of PIL: the common recipe that first builds the dataset as a list of conversations holding decoded PIL images
  (`Image.open(p).convert("RGB")` for every record), then runs the processor per batch;
- datasets.map: `Dataset.from_list(records).map(processor)` storing `pixel_values` in Arrow, then batches read back.
Every method touches the same pixels (their sum is compared). Storage: file MB per 1,000 rows (and the image files
the references point to), prepare seconds and the seconds to collate every row once (collator built beforehand), for
references vs `pixel_values` stored in the Parquet row.
Target: on N=2,000 the feeding itself (peak over baseline) holds at least 3x less with ours than with the list of PIL
images. Prints a table and a JSON line.
"""
import argparse, json, sys, tempfile, time
from pathlib import Path

SIZE = (448, 336)
BATCH = 8
NOISE = 0.25


def make_data(folder, n):
    """N generated records with their images, and the processor folder (Qwen's tokenizer, max_pixels 200,704)."""
    from unsloth_prep.fixtures import processor_folder, write_vision_records
    folder = Path(folder)
    info = write_vision_records(folder / "data", n, size=SIZE, multi_rate=0.0, seed=5, noise=NOISE)
    return info, processor_folder(folder / "processor")


def _records(path):
    recs = json.loads(Path(path).read_text())
    base = Path(path).parent
    return [{**r, "images": [str(base / p) for p in r["images"]]} for r in recs]


def _setup_mb():
    from unsloth_prep.memory import rss_mb
    return rss_mb(children=False)


def feed_ours(parquet, proc, batch=BATCH, collate=None):
    """Collate every prepared row in batches (images decoded per batch); the pixel sum and the RSS after setup."""
    import pyarrow.parquet as pq
    from unsloth_prep.vision import VisionCollator
    collate, total = collate or VisionCollator(proc), 0.0
    setup = _setup_mb()
    for b in pq.ParquetFile(parquet).iter_batches(batch_size=batch):
        total += float(collate(b.to_pylist())["pixel_values"].sum())
    return {"sum": round(total, 1), "setup_mb": setup}


def feed_pil_list(data_json, proc, batch=BATCH):
    """The common recipe: a list of conversations holding decoded PIL images, then the processor per batch."""
    from PIL import Image
    from transformers import AutoImageProcessor
    hf = AutoImageProcessor.from_pretrained(str(proc))
    hf(images=[Image.new("RGB", SIZE)], return_tensors="pt")  # warm, as the others are
    setup = _setup_mb()
    dataset = [{"messages": r["messages"], "images": [Image.open(p).convert("RGB") for p in r["images"]]}
               for r in _records(data_json)]
    total = 0.0
    for i in range(0, len(dataset), batch):
        ims = [im for r in dataset[i:i + batch] for im in r["images"]]
        total += float(hf(images=ims, return_tensors="pt")["pixel_values"].sum())
    return {"sum": round(total, 1), "setup_mb": setup}


def _map_pixels(hf):
    from PIL import Image

    def fn(b):
        ims = [Image.open(p[0]).convert("RGB") for p in b["images"]]
        out = hf(images=ims, return_tensors="np")
        sizes = [int(g[1] * g[2]) for g in out["image_grid_thw"]]
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return {"pixel_values": [out["pixel_values"][s:s + n] for s, n in zip(starts, sizes)],
                "image_grid_thw": out["image_grid_thw"].tolist()}
    return fn


def feed_datasets_map(data_json, proc, cache_dir, batch=BATCH):
    """`datasets.map` storing pixel_values in Arrow (written to `cache_dir`), then every batch read back."""
    import datasets, numpy as np
    from transformers import AutoImageProcessor
    datasets.disable_progress_bars()
    hf = AutoImageProcessor.from_pretrained(str(proc))
    import torch  # noqa: F401  (loaded by the others too)
    setup = _setup_mb()
    ds = datasets.Dataset.from_list(_records(data_json))
    ds = ds.map(_map_pixels(hf), batched=True, batch_size=batch, remove_columns=ds.column_names,
                cache_file_name=str(Path(cache_dir) / "mapped.arrow"))
    ds = ds.with_format("numpy")
    total = 0.0
    for i in range(0, len(ds), batch):
        total += float(sum(np.asarray(p, dtype=np.float32).sum() for p in ds[i:i + batch]["pixel_values"]))
    return {"sum": round(total, 1), "setup_mb": setup}


def memory_benchmark(folder, n=2000):
    """The three feeds on the same N images, each in a fresh process; a list of `memory.MemResult`."""
    from unsloth_prep.memory import isolated
    from unsloth_prep.vision import prepare_vision
    folder = Path(folder)
    info, proc = make_data(folder, n)
    prepare_vision(info["path"], proc, folder / "vision.parquet")
    cache = folder / "map_cache"
    cache.mkdir(exist_ok=True)
    out = [isolated(feed_ours, str(folder / "vision.parquet"), str(proc), label="ours: per-batch decode",
                    keep_result=True),
           isolated(feed_pil_list, info["path"], str(proc), label="list of PIL images", keep_result=True),
           isolated(feed_datasets_map, info["path"], str(proc), str(cache), label="datasets.map pixel_values",
                    keep_result=True)]
    sums = [r.value["sum"] for r in out]
    assert max(sums) - min(sums) <= 1e-4 * max(abs(s) for s in sums) + 1, f"the feeds saw different pixels: {sums}"
    for r in out:
        r.baseline_mb, r.disk_mb = r.value["setup_mb"], 0.0
    out[2].disk_mb = sum(f.stat().st_size for f in cache.iterdir()) / 2**20
    return out


def _pixel_table(parquet, proc):
    """The prepared table with each row's processed pixel_values (float32, flattened) added: the alternative layout."""
    import pyarrow as pa, pyarrow.parquet as pq
    from PIL import Image
    from transformers import AutoImageProcessor
    hf = AutoImageProcessor.from_pretrained(str(proc))
    t = pq.read_table(parquet)
    px = [hf(images=[Image.open(s["path"]).convert("RGB") for s in r], return_tensors="np")["pixel_values"].ravel()
          for r in t.column("images").to_pylist()]
    return t.append_column("pixel_values", pa.array(px, type=pa.list_(pa.float32())))


def collate_pixels(parquet, batch=BATCH):
    """Read stored pixel_values back in batches as tensors (the collate step of the pixel layout); the pixel sum."""
    import numpy as np, pyarrow.parquet as pq, torch
    total = 0.0
    for b in pq.ParquetFile(parquet).iter_batches(batch_size=batch, columns=["pixel_values", "input_ids"]):
        col = b.column("pixel_values")
        flat = np.array(col.values.to_numpy(zero_copy_only=False), dtype=np.float32)
        total += float(torch.from_numpy(flat).view(-1, 1176).sum())
    return round(total, 1)


def storage_costs(folder, n=200):
    """File MB per 1,000 rows, prepare seconds and collate seconds: references + grids vs stored pixel_values."""
    import pyarrow.parquet as pq
    from unsloth_prep.vision import prepare_vision
    folder = Path(folder)
    info, proc = make_data(folder, n)
    t0 = time.perf_counter()
    prepare_vision(info["path"], proc, folder / "refs.parquet")
    t_refs = time.perf_counter() - t0
    pq.write_table(_pixel_table(folder / "refs.parquet", proc), folder / "pixels.parquet")
    t_px = time.perf_counter() - t0
    from unsloth_prep.vision import VisionCollator
    collate = VisionCollator(proc)
    t0 = time.perf_counter()
    s_refs = feed_ours(folder / "refs.parquet", proc, collate=collate)["sum"]
    c_refs = time.perf_counter() - t0
    t0 = time.perf_counter()
    s_px = collate_pixels(folder / "pixels.parquet")
    c_px = time.perf_counter() - t0
    assert abs(s_refs - s_px) <= 1e-4 * abs(s_px) + 1, (s_refs, s_px)
    per_k = lambda p: round((folder / p).stat().st_size / 2**20 * 1000 / n, 2)
    images = round(info["image_bytes"] / 2**20 * 1000 / n, 2)
    return [{"layout": "references + grids", "mb_per_1000_rows": per_k("refs.parquet"), "image_files_mb": images,
             "prepare_s": round(t_refs, 2), "collate_s": round(c_refs, 2), "rows": n},
            {"layout": "pixel_values in the row", "mb_per_1000_rows": per_k("pixels.parquet"), "image_files_mb": 0,
             "prepare_s": round(t_px, 2), "collate_s": round(c_px, 2)}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="200 images (a quick pass)")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args()
    n = a.n or (200 if a.small else 2000)
    with tempfile.TemporaryDirectory() as d:
        mem = memory_benchmark(Path(d) / "mem", n)
        store = storage_costs(Path(d) / "store", min(n, 500))
    print(f"| feed ({n} images {SIZE[0]}x{SIZE[1]}) | peak RSS MB | over baseline MB | seconds | disk MB |")
    print("|---|---:|---:|---:|---:|")
    for r in mem: print(f"| {r.label} | {r.peak_mb:,.0f} | {r.delta_mb:,.0f} | {r.seconds:.1f} | {r.disk_mb:,.0f} |")
    print(f"\n| layout ({store[0]['rows']} rows) | MB per 1,000 rows | + image files MB | prepare s | collate s |")
    print("|---|---:|---:|---:|---:|")
    for s in store:
        print(f"| {s['layout']} | {s['mb_per_1000_rows']} | {s['image_files_mb']} | {s['prepare_s']} | "
              f"{s['collate_s']} |")
    res = {"n": n, "memory": [{**r.summary(), "disk_mb": round(r.disk_mb, 1)} for r in mem], "storage": store,
           "pil_over_ours": round(mem[1].delta_mb / max(mem[0].delta_mb, 1), 2),
           "map_over_ours": round(mem[2].delta_mb / max(mem[0].delta_mb, 1), 2)}
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    ok = res["pil_over_ours"] >= 3 or n < 2000
    print("target (feeding memory >= 3x below the list of PIL images at 2,000):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
