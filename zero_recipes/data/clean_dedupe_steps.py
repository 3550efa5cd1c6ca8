"""The dedupe stages of `tools/clean_data.py --executor`, after `clean_steps.py` wrote each task's signatures:
candidate pairs per band (many tasks), clusters (one task), and the filter (one task per input share).

They follow datatrove's MinHash stages 2-4 and read its stage-1 files with its `read_sigs`, but decide as the
in-memory path (`dedupe.near`/`dedupe.exact`) does, so both keep the same documents:
- a candidate pair (two documents whose band hashes are equal) counts only when their whole signatures agree on
  `threshold` of their hashes (datatrove keeps every pair that shares a band). Each document is compared with
  the first of its group, as `dedupe.near` does; the whole signatures are read from disk (`full/`), so memory
  stays one record per open file;
- a cluster keeps its FIRST document in input order (datatrove keeps the root of a union by size).
"""

from __future__ import annotations

import heapq
import json
import struct
from pathlib import Path

import numpy as np
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import MinhashConfig, read_sigs
from datatrove.utils.hashing import HashConfig

from .clean_file import EXAMPLES_PER_REASON
from .clean_steps import jsonl, published, row_text, write_array, write_part

PAIR = struct.Struct("<4I")  # (file, doc, file, doc): the first document of the group, then the later one
REMOVE = np.dtype([("doc", "<u4"), ("of_file", "<u4"), ("of_doc", "<u4"), ("of_index", "<i8"), ("similarity", "<f4")])


class Keys:
    """The whole dedupe keys (`full/RRRRR.u32`) and line numbers (`index/RRRRR.i64`) the signature step wrote,
    memory-mapped: a lookup reads the page it needs."""

    def __init__(self, folder: Path, width: int):
        self.folder, self.width, self.maps = folder, width, {}

    def key(self, file: int, doc: int) -> np.ndarray:
        if ("full", file) not in self.maps:
            path = self.folder / "full" / f"{file:05d}.u32"
            self.maps["full", file] = np.memmap(path, dtype="<u4", mode="r").reshape(-1, self.width)
        return self.maps["full", file][doc]

    def index(self, file: int) -> np.ndarray:
        if ("index", file) not in self.maps:
            self.maps["index", file] = np.fromfile(self.folder / "index" / f"{file:05d}.i64", dtype="<i8")
        return self.maps["index", file]

    def similarity(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        return float((self.key(*a) == self.key(*b)).mean())


class FindDuplicatePairs(PipelineStep):
    """Task `rank` merges the sorted signature files of bands rank, rank + world_size, ... across all input
    tasks (datatrove's `read_sigs` in a heap) and writes the verified pairs to `pairs/BBB.dups`."""

    name = "dedupe: verified pairs per band"
    type = "DEDUP"

    def __init__(self, sigs: str, pairs: str, bands: int, rows: int, width: int, threshold: float):
        super().__init__()
        self.sigs, self.pairs = sigs, Path(pairs)
        self.bands, self.rows, self.width, self.threshold = bands, rows, width, threshold

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        config = MinhashConfig(
            num_buckets=self.bands, hashes_per_bucket=self.rows, hash_config=HashConfig(precision=32)
        )
        keys = Keys(Path(self.sigs), self.width)
        folder = get_datafolder(self.sigs)
        for band in range(rank, self.bands, world_size):
            files = sorted(folder.list_files(subdirectory=f"bucket_{band:03d}"))
            readers = [read_sigs(f, i, config) for i, f in enumerate(folder.open_files(files, mode="rb"))]
            queue = [s for s in (next(r, None) for r in readers) if s is not None]
            heapq.heapify(queue)
            found = []
            first = None
            while queue:
                sig = heapq.heappop(queue)
                # read_sigs orders by (hashes, file, doc): the first of a group is its earliest document
                if first is not None and sig.sig == first.sig:
                    a, b = (int(first.file_stem), first.doc_id), (int(sig.file_stem), sig.doc_id)
                    if keys.similarity(a, b) >= self.threshold:
                        found.append(PAIR.pack(*a, *b))
                        self.stat_update("verified pairs")
                    else:
                        self.stat_update("pairs below the threshold")
                else:
                    first = sig
                following = next(readers[sig.reader_id], None)
                if following is not None:
                    heapq.heappush(queue, following)
            self.pairs.mkdir(parents=True, exist_ok=True)
            write_array(self.pairs / f"{band:03d}.dups", np.frombuffer(b"".join(found), dtype=np.uint8))


class ClusterDuplicates(PipelineStep):
    """One task: the verified pairs of every band joined into clusters; each cluster keeps its earliest
    document, and per input task `remove/RRRRR.remove` lists the others with the document they repeat."""

    name = "dedupe: clusters"
    type = "DEDUP"

    def __init__(self, sigs: str, pairs: str, remove: str, width: int):
        super().__init__()
        self.sigs, self.pairs, self.remove, self.width = Path(sigs), Path(pairs), Path(remove), width

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        parent: dict[int, int] = {}  # documents in some pair only: file << 32 | doc -> a document of its cluster

        def root(x: int) -> int:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for path in sorted(self.pairs.glob("*.dups")):
            for f1, d1, f2, d2 in PAIR.iter_unpack(path.read_bytes()):
                ra, rb = root(f1 << 32 | d1), root(f2 << 32 | d2)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)  # the earlier document stays the root
        keys = Keys(self.sigs, self.width)
        per_file: dict[int, list] = {}
        for node in sorted(parent):
            top = root(node)
            if top != node:
                (f, d), (rf, rd) = divmod(node, 1 << 32), divmod(top, 1 << 32)
                sim = keys.similarity((f, d), (rf, rd))
                per_file.setdefault(f, []).append((d, rf, rd, keys.index(rf)[rd], sim))
                self.stat_update("duplicates")
        self.remove.mkdir(parents=True, exist_ok=True)
        for f, rows in per_file.items():
            write_array(self.remove / f"{f:05d}.remove", np.array(rows, dtype=REMOVE))


class DropDuplicates(PipelineStep):
    """Task `rank` reads its documents left after cleaning (`kept/RRRRR.jsonl`), writes those no cluster
    removes to the output's `RRRRR.jsonl`, and the others, with why and `duplicate_of` (the line of the
    document kept for them), to the removed rows; the first examples go to its part of the report."""

    name = "dedupe: filter"
    type = "DEDUP"

    def __init__(self, kept, remove, output, removed, parts, staging, reason: str, fmt: str, opts):
        super().__init__()
        self.fmt, self.opts = fmt, opts
        self.kept, self.remove, self.output = Path(kept), Path(remove), Path(output)
        self.removed, self.parts, self.staging, self.reason = Path(removed), Path(parts), Path(staging), reason

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        path = self.remove / f"{rank:05d}.remove"
        drop = np.fromfile(path, dtype=REMOVE) if path.exists() else np.zeros(0, dtype=REMOVE)
        by_doc = {int(r["doc"]): r for r in drop}
        part = {"removed": {self.reason: {"documents": len(drop), "examples": []}}}
        name = f"{rank:05d}.jsonl"
        with (
            published(self.output / name, self.staging) as out,
            published(self.removed / f"dedupe-{name}", self.staging) as removed,
            open(self.kept / name, encoding="utf-8") as rows,
        ):
            for doc, line in enumerate(rows):
                item = json.loads(line)
                r = by_doc.get(doc)
                if r is None:
                    out.write(jsonl(item["row"]))
                    self.stat_update("kept")
                    continue
                removed.write(jsonl(item["row"] | {"removed_because": self.reason, "duplicate_of": int(r["of_index"])}))
                examples = part["removed"][self.reason]["examples"]
                if len(examples) < EXAMPLES_PER_REASON:
                    text = row_text(item["row"], self.fmt, self.opts)
                    of = [int(r["of_file"]), int(r["of_doc"]), int(r["of_index"])]
                    examples.append(
                        {"index": item["index"], "text": text, "of": of, "similarity": float(r["similarity"])}
                    )
        write_part(self.parts / f"dedupe-{rank:05d}.json", part, self.staging)
