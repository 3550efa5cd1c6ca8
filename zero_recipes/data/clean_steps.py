"""The per-document stage of `tools/clean_data.py --executor`: datatrove pipeline steps that read a share of
the input, run train.py's edits and judges on it, write MinHash signatures in datatrove's stage-1 format, and
write the documents that go on to the dedupe stages (`clean_dedupe_steps.py`).

Each step is a datatrove `PipelineStep`, so any of datatrove's executors runs it, one task per rank, and its
completions make a rerun skip finished tasks. The edits and judges are `clean_file.CleanBatch`, the very code
the in-memory path maps over its batches: both paths decide every document alike.

What datatrove lacks, and is written here: a reader that splits ONE JSON-lines file into byte ranges (its
readers shard by file, so a single file would run on one task), and writers that keep each row's fields as the
input had them (datatrove's `Document` keeps a text and metadata) and rename a task's files into place only when
the task is done (a killed task leaves no half file for the rerun to trip on).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep

from .clean_file import EXAMPLE_CHARS, EXAMPLES_PER_REASON, INTERNAL, CleanBatch
from .formats import content_text

BATCH = 500  # the in-memory path's batch size; the steps' results do not depend on it


@contextmanager
def published(path: Path, staging: Path):
    """Write `path` under `staging` (same filesystem) and rename it into place when the body succeeds."""
    staging.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging / f"{path.parent.name}-{path.name}.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def jsonl(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"


def line_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The bytes [start, end) of a file whose lines task `rank` of `world_size` reads: a line belongs to the
    task in whose range it starts."""
    return size * rank // world_size, size * (rank + 1) // world_size


class CountLines(PipelineStep):
    """Stage 0: the newlines in task `rank`'s byte range (`lines/RRRRR`), so that each reader knows its first
    line's number from the counts before it, and the file is read once across all tasks, not once per task."""

    name = "count lines"
    type = "READER"

    def __init__(self, path: str, folder: str):
        super().__init__()
        self.path, self.folder = path, Path(folder)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        start, end = line_range(os.path.getsize(self.path), rank, world_size)
        n, left = 0, end - start
        with open(self.path, "rb") as f:
            f.seek(start)
            while left > 0:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    break
                n += chunk.count(b"\n")
                left -= len(chunk)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{rank:05d}.{os.getpid()}"
        tmp.write_text(str(n))
        os.replace(tmp, self.folder / f"{rank:05d}")
        return iter(())


class ReadRows(PipelineStep):
    """Task `rank`'s lines of one JSON-lines file, in order, as Documents whose metadata holds the row and its
    0-based line number (`index`, the in-memory path's row index when the file has no blank lines)."""

    name = "read rows"
    type = "READER"

    def __init__(self, path: str, line_counts: str):
        super().__init__()
        self.path, self.line_counts = path, Path(line_counts)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        start, end = line_range(os.path.getsize(self.path), rank, world_size)
        # the lines that end before `start` are those the earlier ranges hold
        index = sum(int((self.line_counts / f"{r:05d}").read_text()) for r in range(rank))
        with open(self.path, "rb") as f:
            if start:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line that started in the previous task's range is that task's
                    index += 1
            pos = f.tell()
            while pos < end:
                line = f.readline()
                if not line:
                    break
                pos += len(line)
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"line {index + 1} of {self.path} is not JSON ({e.msg})") from None
                    self.stat_update("documents")
                    yield Document(text="", id=str(index), metadata={"row": row, "index": index})
                index += 1


def batches(data, size: int = BATCH):
    batch = []
    for doc in data:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class CleanRows(PipelineStep):
    """train.py's edits and judges (`CleanBatch`) on each batch of documents. A dropped document is written to
    the task's removed file with why; the rest go on, with their dedupe key in metadata (`key`). What each edit
    changed and each judge removed is counted in a per-task part of the report, with the first examples."""

    name = "clean (edits, garbled, quality)"
    type = "FILTER"

    def __init__(self, opts, fmt: str, removed_dir: str, parts_dir: str, staging: str):
        super().__init__()
        self.opts, self.fmt = opts, fmt  # opts: DataOptions (CleanBatch reads its dedupe and tokenize options)
        self.removed_dir, self.parts_dir, self.staging = Path(removed_dir), Path(parts_dir), Path(staging)

    def run(self, data, rank: int = 0, world_size: int = 1):
        clean = CleanBatch(self.opts, self.fmt)
        part = {"documents": 0, "edited": {}, "removed": {}}
        removed_file = self.removed_dir / f"clean-{rank:05d}.jsonl"
        with published(removed_file, self.staging) as removed:
            for docs in batches(data):
                rows = [d.metadata["row"] for d in docs]
                columns = list(dict.fromkeys(c for r in rows for c in r))
                out = clean({c: [r.get(c) for r in rows] for c in columns})
                for i, doc in enumerate(docs):
                    row = doc.metadata["row"]
                    row.update({c: v[i] for c, v in out.items() if c not in INTERNAL})
                    for step in out["_edited"][i]:
                        part["edited"][step] = part["edited"].get(step, 0) + 1
                    why = out["_drop"][i]
                    if why:
                        self.stat_update(why)
                        seen = part["removed"].setdefault(why, {"documents": 0, "examples": []})
                        seen["documents"] += 1
                        if len(seen["examples"]) < EXAMPLES_PER_REASON:
                            seen["examples"].append(self.example(doc))
                        removed.write(jsonl(row | {"removed_because": why, "duplicate_of": -1}))
                        continue
                    for column in ("_minhash", "_hash"):
                        if column in out:
                            doc.metadata["key"] = out[column][i]
                    yield doc
                part["documents"] += len(docs)
        write_part(self.parts_dir / f"clean-{rank:05d}.json", part, self.staging)

    def example(self, doc: Document) -> dict:
        return {"index": doc.metadata["index"], "text": row_text(doc.metadata["row"], self.fmt, self.opts.tokenize)}


def row_text(row: dict, fmt: str, opts) -> str:
    text = str(row.get(opts.text_column) or "") if fmt == "text" else content_text(fmt, row)
    return text[:EXAMPLE_CHARS]


def write_part(path: Path, part: dict, staging: Path) -> None:
    with published(path, staging) as f:
        json.dump(part, f, ensure_ascii=False)


class WriteSignatures(PipelineStep):
    """Each document's dedupe key, in datatrove's MinHash stage-1 layout (`bucket_BBB/RRRRR.minhash.sig`:
    per band, records of `rows` uint32 hashes and the document's number in this task, sorted), which
    datatrove's `read_sigs` merges in the buckets stage. Beside it, the whole key per document (`full/`) and
    its line number (`index/`), which the buckets stage reads to verify a candidate pair and the cluster stage
    to name the document a duplicate repeats. An exact hash is one band of two uint32 halves."""

    name = "dedupe signatures"
    type = "DEDUP"

    def __init__(self, folder: str, bands: int, rows: int, key_width: int):
        super().__init__()
        self.folder, self.bands, self.rows, self.key_width = Path(folder), bands, rows, key_width

    def record_dtype(self) -> np.dtype:
        return np.dtype([(f"h{i}", "<u4") for i in range(self.rows)] + [("doc", "<u4")])

    def run(self, data, rank: int = 0, world_size: int = 1):
        keys, index = [], []
        full_path = self.folder / "full" / f"{rank:05d}.u32"
        full_path.parent.mkdir(parents=True, exist_ok=True)
        with open(full_path, "wb") as full:
            for doc in data:
                key = as_key(doc.metadata.pop("key"), self.key_width)
                full.write(key.tobytes())
                keys.append(key[: self.bands * self.rows])
                index.append(doc.metadata["index"])
                yield doc
        write_array(self.folder / "index" / f"{rank:05d}.i64", np.asarray(index, dtype="<i8"))
        cut = np.asarray(keys, dtype="<u4").reshape(len(keys), self.bands, self.rows)
        for band in range(self.bands):
            records = np.zeros(len(keys), dtype=self.record_dtype())
            for i in range(self.rows):
                records[f"h{i}"] = cut[:, band, i]
            records["doc"] = np.arange(len(keys), dtype="<u4")
            records.sort(order=records.dtype.names)
            write_array(self.folder / f"bucket_{band:03d}" / f"{rank:05d}.minhash.sig", records)


def as_key(value, width: int) -> np.ndarray:
    """A dedupe key as `width` uint32: a MinHash signature as it is, an exact 63-bit hash as its two halves."""
    if width == 2:
        h = int(value)
        return np.array([h >> 32, h & 0xFFFFFFFF], dtype="<u4")
    return np.asarray(value, dtype="<u4").reshape(width)


def write_array(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    array.tofile(tmp)
    os.replace(tmp, path)


class WriteRows(PipelineStep):
    """The task's documents that are left, to `RRRRR.jsonl` in `folder`: each row as the input had it (with the
    edits' repairs), or, for the dedupe stages to read (`with_index`), `{"index": line, "row": row}`."""

    name = "write rows"
    type = "WRITER"

    def __init__(self, folder: str, staging: str, with_index: bool):
        super().__init__()
        self.folder, self.staging, self.with_index = Path(folder), Path(staging), with_index

    def run(self, data, rank: int = 0, world_size: int = 1):
        with published(self.folder / f"{rank:05d}.jsonl", self.staging) as f:
            for doc in data:
                row = doc.metadata["row"]
                f.write(jsonl({"index": doc.metadata["index"], "row": row} if self.with_index else row))
                self.stat_update("written")
                yield doc
