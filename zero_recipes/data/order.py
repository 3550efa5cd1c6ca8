"""Which rows each rank trains on, in what order: a seeded per-epoch shuffle, sharded by rank, that
resumes by seeking to (epoch, index). A resume never replays the batches it skips (HF's
`ignore_data_skip` exists because it does). Mixtures draw each dataset's share of rows by weight."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .packing import Samples, collate


class Mixture:
    """Several row sources as one: dataset k contributes round(w_k * total) rows per epoch, a seeded
    subset when it has more rows than that and whole repeats (plus a subset) when it has fewer."""

    def __init__(self, parts: list[Samples], weights: list[float], seed: int):
        self.parts = parts
        total = sum(len(p) for p in parts)
        refs = []
        rng = np.random.default_rng([seed, 7919])
        for k, (part, w) in enumerate(zip(parts, weights)):
            want, have = int(round(w * total)), len(part)
            if have == 0 or want == 0:
                continue
            picks = np.concatenate([np.tile(np.arange(have), want // have), rng.permutation(have)[: want % have]])
            refs.append(np.stack([np.full(len(picks), k), np.sort(picks)], axis=1))
        self.refs = np.concatenate(refs) if refs else np.zeros((0, 2), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.refs)

    def row(self, i: int):
        k, j = self.refs[i]
        return self.parts[k].row(int(j))

    def row_lengths(self) -> np.ndarray:
        out = np.zeros(len(self.refs), dtype=np.int64)
        for k, part in enumerate(self.parts):
            sel = self.refs[:, 0] == k
            out[sel] = part.row_lengths()[self.refs[sel, 1]]
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.row_lengths().sum())


class BatchOrder:
    def __init__(self, rows, micro_batch: int, rank: int, world: int, seed: int, pad_id: int):
        self.rows, self.micro, self.rank, self.world, self.seed, self.pad_id = (
            rows,
            micro_batch,
            rank,
            world,
            seed,
            pad_id,
        )
        self.per_rank = len(rows) // world // micro_batch  # micro-batches per rank per epoch
        if self.per_rank == 0:
            raise ConfigError(
                f"{len(rows)} training rows cannot fill one micro-batch of {micro_batch} on each of "
                f"{world} ranks; lower --per_device_train_batch_size or --block_size, or use more data"
            )
        self.epoch, self.index = 0, 0
        self._order = None

    def _epoch_order(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.epoch])
        perm = rng.permutation(len(self.rows))[: self.per_rank * self.micro * self.world]
        return perm[self.rank :: self.world]

    def next_indices(self) -> np.ndarray:
        if self.index >= self.per_rank:
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order()
        idx = np.sort(self._order[self.index * self.micro : (self.index + 1) * self.micro])
        self.index += 1
        return idx

    def next_batch(self) -> dict:
        collated = getattr(self.rows, "collate", collate)  # rows with their own layout (preference pairs) say so
        return collated([self.rows.row(int(i)) for i in self.next_indices()], self.pad_id)

    @property
    def epoch_progress(self) -> float:
        return self.epoch + self.index / self.per_rank

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "world": self.world, "micro": self.micro}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], None


def eval_batches(rows, micro_batch: int, rank: int, world: int, max_batches: int, pad_id: int):
    """Every rank gets the same number of batches (ZeRO-3 forwards are collective); padding rows repeat
    real rows with weight 0 so each row counts once."""
    import torch

    n = len(rows) if rows is not None else 0
    if n == 0:
        return
    per_rank = -(-n // (world * micro_batch))
    if max_batches:
        per_rank = min(per_rank, max_batches)
    for b in range(per_rank):
        idx = np.arange(micro_batch) + (b * world + rank) * micro_batch
        weight = torch.from_numpy((idx < n).astype(np.float32))
        collated = getattr(rows, "collate", collate)  # rows with their own layout (preference pairs) say so
        yield collated([rows.row(int(i % n)) for i in idx], pad_id), weight
