"""A task added to unsloth_prep from outside the package: one module and its registration. It counts the characters of
each record's `text` field (and keeps the records that have none as rejects)."""
import json

import pyarrow as pa
import pyarrow.parquet as pq

from unsloth_prep.loading import Rejects
from unsloth_prep.parallel import iter_shard
from unsloth_prep.steps import Step, declare, register

declare("lowercase", flag=True, default=False, help="count the characters of the lower-cased text")


class CharCount(Step):
    "Each record's number of characters (its text lower-cased first with --lowercase)."
    name, options, columns, sums = "charcount", ("lowercase",), ("chars",), ("records", "rows", "rejected")

    def records(self, spec, opts, rejects, report=None):
        for place, rec in iter_shard(spec, opts.on_error, rejects, report):
            if isinstance(rec.get("text"), str): yield place, {"text": rec["text"]}
            elif opts.on_error == "raise": raise ValueError(f"{place[0]}: {place[2]} {place[1]}: field 'text' missing")
            else: rejects.add(place[0], place[1], "field 'text' missing", json.dumps(rec), place[2])

    def run(self, job, state=None, report=None):
        rej, o = Rejects(path=job["rejects"], keep=100), job["opts"]
        try: texts = [r["text"].lower() if o.lowercase else r["text"] for _, r in self.records(job["spec"], o, rej)]
        finally: rej.close()
        pq.write_table(pa.table({"chars": pa.array([len(t) for t in texts], pa.int32())}), job["out"])
        return {"records": len(texts) + rej.count, "rows": len(texts), "rejected": rej.count, "rejects": rej.items}


register(CharCount())
