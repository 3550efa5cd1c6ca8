"""Streaming: read, tokenise and lay out rows on the fly, for corpora too big to prepare up front.

Each rank reads its own shard (`datasets.distributed.split_dataset_by_node`) in file order. The position
is (epoch, example, token offset) in that shard, saved per rank in the checkpoint; a resume skips the
consumed examples without tokenising them and continues at the same token, so the batches after a
resume are the uninterrupted run's. Text rows are windows of the concatenated stream; SFT rows are
whole examples, greedily packed in order when `packing` is on.
"""

from __future__ import annotations

import numpy as np

from zero_recipes.data.preparation import Prepared

from ..errors import ConfigError
from . import cleaning, formats, packing, sources
from .options import DataOptions

CHUNK = 256  # examples tokenised per call


def prepare_stream(cfg, tok, rank: int, world: int, log) -> Prepared:
    specs = sources.dataset_specs(cfg)
    if len(specs) != 1:
        raise ConfigError("--streaming reads one dataset; mix datasets without --streaming, or pre-mix the files")
    spec = specs[0]
    source = sources.describe(spec, cfg)
    head = sources.load(spec, source, spec.split, streaming=True, trust_remote_code=cfg.trust_remote_code)
    columns = head.column_names or list(next(iter(head)).keys())
    opts = DataOptions.from_config(cfg, spec)
    fmt, how = formats.detect_format(opts.tokenize.format, columns, opts.tokenize.text_column, spec.name)
    opts = opts.resolved(fmt)  # dedupe is off: config.validate_cleaning refuses it with streaming
    cleaning.check_format(opts.tokenize, spec.name)
    log(f"data: {spec.name}: {how}; streaming, sharded over {world} rank(s)")
    if fmt == "messages":
        formats.ensure_chat_template(tok, log)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n_eval = (
        0
        if spec.eval_split or opts.validation_split_percentage == 0
        else (cfg.max_eval_batches or 50) * cfg.per_device_eval_batch_size * world
    )
    train = StreamOrder(cfg, spec, source, tok, opts, rank, world, pad_id, skip=n_eval)
    evald = None
    if spec.eval_split or n_eval:
        split = spec.eval_split or spec.split
        n = n_eval or (cfg.max_eval_batches or 50) * cfg.per_device_eval_batch_size * world
        ds = sources.load(spec, source, split, streaming=True, trust_remote_code=cfg.trust_remote_code).take(n)
        evald = materialise(ds, formats.Tokenize(tok, opts.tokenize), fmt, opts.block_size)
        log(
            f"data: eval: {len(evald)} rows from the first {n} examples of split '{split}'"
            + ("" if spec.eval_split else ", which training skips")
        )
    return Prepared(train, evald, [fmt], pad_id)


def materialise(ds, fn, fmt, block) -> packing.Samples:
    ids, masks = [], []
    for i, batch in enumerate(ds.iter(batch_size=CHUNK)):
        out = fn(batch, list(range(i * CHUNK + 1, i * CHUNK + 1 + len(next(iter(batch.values()))))))
        for x, m, why in formats.split_examples({k: v[0] for k, v in out.items()}):
            if not why and (fmt == "text" or len(x) <= block):
                ids.append(x)
                masks.append(m)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
    if fmt == "text":
        seg, ptr = packing.windows(len(tokens), block)
        return packing.Samples(tokens, None, seg, ptr)
    mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    seg, ptr = packing.one_per_row(starts, lengths)
    return packing.Samples(tokens, mask, seg, ptr)


class StreamOrder:
    """The streaming counterpart of BatchOrder: next_batch(), state_dict(), load_state_dict()."""

    def __init__(self, cfg, spec, source, tok, opts: DataOptions, rank, world, pad_id, skip: int):
        """`opts` with the detected format (`DataOptions.resolved`)."""
        self.cfg, self.spec, self.source, self.fmt = cfg, spec, source, opts.tokenize.format
        self.rank, self.world, self.pad_id, self.skip = rank, world, pad_id, skip
        self.micro, self.block, self.packing = cfg.per_device_train_batch_size, opts.block_size, opts.packing
        self.fn = formats.Tokenize(tok, opts.tokenize)
        self.epoch, self.example, self.offset = 0, 0, 0  # next unconsumed token: example's token `offset`
        self.dropped = 0
        self.cleaned = {}  # drop reason -> documents this rank's reader skipped
        self._it = None
        self._current = None  # (example index, ids, mask) at self.example

    # -- position --
    @property
    def epoch_progress(self) -> float:
        return float(self.epoch)

    per_rank = 1  # rows per epoch are unknown while streaming

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "example": self.example, "offset": self.offset, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        if "example" not in state:
            raise ConfigError("this checkpoint was not written by a --streaming run; resume it without --streaming")
        self.epoch, self.example, self.offset = state["epoch"], state["example"], state["offset"]
        self._it, self._current = None, None

    # -- reading --
    def _examples(self):
        from datasets.distributed import split_dataset_by_node

        ds = sources.load(
            self.spec, self.source, self.spec.split, streaming=True, trust_remote_code=self.cfg.trust_remote_code
        )
        if self.skip:
            ds = ds.skip(self.skip)
        ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world)
        # Resume: read past the consumed examples without tokenising them. Not ds.skip(): after
        # split_dataset_by_node it skips in the global stream (measured: rank 1 of 2 then yields 4, 6, ...).
        start = self.example
        index = 0
        for batch in ds.iter(batch_size=CHUNK):
            n = len(next(iter(batch.values())))
            if index + n <= start:
                index += n
                continue
            if index < start:
                batch = {k: v[start - index :] for k, v in batch.items()}
                n, index = n - (start - index), start
            out = self.fn(batch, list(range(index + 1, index + n + 1)))
            for j, (ids, mask, why) in enumerate(formats.split_examples({k: v[0] for k, v in out.items()})):
                if why:  # dropped by cleaning; its index still counts, so a resume lands on the same example
                    self.cleaned[why] = self.cleaned.get(why, 0) + 1
                else:
                    yield index + j, ids, mask
            index += n

    def _peek(self):
        """The example at self.example, reading on (and into the next epoch) as needed."""
        if self._current is None or self._current[0] != self.example:
            if self._it is None:
                self._it = self._examples()
            item = next(self._it, None)
            if item is None:
                if self.example == 0:
                    raise ConfigError(
                        f"dataset '{self.spec.name}' streams no examples to rank {self.rank}; "
                        "use fewer ranks or more data"
                    )
                self.epoch, self.example, self.offset, self._it = self.epoch + 1, 0, 0, None
                return self._peek()
            self._current = item
            self.example = item[0]  # past any examples cleaning dropped
        return self._current

    def _advance(self):
        self.example, self.offset = self.example + 1, 0

    def _row(self):
        if self.fmt == "text":  # a window of the concatenated stream
            need, pieces = self.block, []
            while need:
                _, ids, _ = self._peek()
                take = ids[self.offset : self.offset + need]
                pieces.append(take)
                need -= len(take)
                self.offset += len(take)
                if self.offset >= len(ids):
                    self._advance()
            return [(np.concatenate(pieces), None)]
        row, used = [], 0
        while True:
            _, ids, mask = self._peek()
            if len(ids) > self.block:
                self.dropped += 1
                self._advance()
                continue
            if row and (not self.packing or used + len(ids) > self.block):
                return row
            row.append((ids, mask))
            used += len(ids)
            self._advance()
            if not self.packing:
                return row

    def next_batch(self) -> dict:
        return packing.collate([self._row() for _ in range(self.micro)], self.pad_id)
