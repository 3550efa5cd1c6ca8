"""Duplicate documents: exact (by hash), or near (MinHash signatures of shingles that suit the script, then
LSH in memory). Both answer, per document, which earlier document it repeats.

Signatures are datatrove's (`MinhashDedupSignature`: its text simplification, n-gram shingles and
universal hashing, with FineWeb's 5-grams and 14 x 8 = 112 hashes), computed per batch inside the
tokenisation map so they use every worker. Shingles are 5 words, or 5 characters where the script is
written without spaces (`scripts.unspaced`): word shingles of Chinese would be whole sentences.

Matching is written here because datatrove's stages 2-4 (buckets, cluster, filter) sort signature files on
disk across tasks, which is what a cluster needs and a single run does not. This is the same algorithm in
memory, with one step datatrove leaves out: a pair that shares a band is kept only when its signatures agree
on at least `threshold` of their hashes (the MinHash estimate of the shingles' Jaccard similarity), so
bands can be cut finer for recall without losing precision.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .scripts import unspaced

N_GRAMS = 5
NUM_HASHES = 112  # datatrove's 14 buckets x 8 hashes
DEFAULT_THRESHOLD = 0.7


@lru_cache(2)
def _signer(unspaced_script: bool):
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Shingles(WordTokenizer):
        """The units of a shingle: characters of unspaced scripts, else space-separated words (the text
        is already lowercased and stripped of punctuation by datatrove's `simplify_text`)."""

        def word_tokenize(self, text):
            return [c for c in text if not c.isspace()] if unspaced_script else text.split()

        def sent_tokenize(self, text):
            return [text]

        def span_tokenize(self, text):
            return [(0, len(text))]

    # 32-bit hashes halve the index; sha1 because datatrove's xxhash path passes str, which xxhash 4 refuses
    config = MinhashConfig(
        n_grams=N_GRAMS,
        num_buckets=14,
        hashes_per_bucket=8,
        hash_config=HashConfig(precision=32, hash_fc="sha1"),
    )
    # output_folder is only written by the step's run(), which this never calls
    return MinhashDedupSignature(output_folder="unused-minhash-folder", config=config, language=Shingles())


def signature(text: str) -> np.ndarray:
    """NUM_HASHES uint32 min-hashes of `text`'s shingles (one shingle of the whole text if it is shorter
    than N_GRAMS units, so short documents are compared whole)."""
    signer = _signer(unspaced(text))
    shingles = signer.get_shingles(text)
    if len(shingles) == 0:
        shingles = np.array([[signer._hash_func(text.strip().lower() or " ")]], dtype=np.uint64)
    return np.asarray(signer.get_signature(shingles), dtype=np.uint32).reshape(-1)


def band_shape(threshold: float, num_hashes: int = NUM_HASHES) -> tuple[int, int]:
    """(bands, rows per band) for LSH: the most rows per band (fewest chance collisions to verify) that
    still make a pair at `threshold` share a band with probability >= 0.99."""
    for rows in range(num_hashes, 0, -1):
        bands = num_hashes // rows
        if 1 - (1 - threshold**rows) ** bands >= 0.99:
            return bands, rows
    return num_hashes, 1


def exact(hashes: np.ndarray) -> np.ndarray:
    """For each document, -1 if it is the first with its hash, else the index of that first one."""
    _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
    matched = first[inverse.reshape(-1)].astype(np.int64)
    matched[matched == np.arange(len(hashes))] = -1
    return matched


def near(signatures: np.ndarray, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
    """For each document (rows of `signatures`), -1 if it is kept, else the index of the earlier document it
    was matched to. Documents linked by matches form one cluster, of which the first is kept."""
    n = len(signatures)
    parent = np.arange(n)
    matched = np.full(n, -1, dtype=np.int64)
    if n < 2:
        return matched

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    bands, rows = band_shape(threshold, signatures.shape[1])
    sigs = np.ascontiguousarray(signatures[:, : bands * rows])
    for b in range(bands):
        # one hashable key per document and band; documents with equal keys are candidates
        key = np.ascontiguousarray(sigs[:, b * rows : (b + 1) * rows]).view(np.dtype((np.void, 4 * rows))).ravel()
        order = np.argsort(key, kind="stable")  # stable: within a group, ascending document index
        k = key[order]
        same = np.flatnonzero(k[1:] == k[:-1]) + 1  # positions whose key equals the previous one
        if not len(same):
            continue
        # each candidate is compared with the first document of its group (as datatrove's buckets do),
        # which keeps the work linear when many documents share a band
        starts = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
        first = order[starts[np.searchsorted(starts, same, side="right") - 1]]
        later = order[same]
        similar = (signatures[first] == signatures[later]).mean(axis=1) >= threshold
        for a, d in zip(first[similar], later[similar]):
            ra, rd = root(a), root(d)
            if ra != rd:
                parent[max(ra, rd)] = min(ra, rd)
            if matched[d] < 0:
                matched[d] = a
    roots = np.array([root(i) for i in range(n)])
    dup = roots != np.arange(n)
    # a cluster's first document is kept even if it was matched (to a later document's cluster)
    matched[~dup] = -1
    unmatched = dup & (matched < 0)
    matched[unmatched] = roots[unmatched]
    return matched


def among(mode: str, keys: np.ndarray, keep: np.ndarray, threshold: float) -> tuple[str, np.ndarray]:
    """Dedupe the documents `keep` marks, by their `keys` (exact hashes, or MinHash signatures when `mode`
    is "near"): the step's report name, and per document the index of the earlier one it repeats, or -1."""
    candidates = np.flatnonzero(keep)
    if mode == "exact":
        what, found = "exact duplicates", exact(keys[candidates])
    else:
        what, found = f"near duplicates (similarity >= {threshold})", near(keys[candidates], threshold)
    matched = np.full(len(keep), -1, dtype=np.int64)
    matched[candidates[found >= 0]] = candidates[found[found >= 0]]
    return what, matched
