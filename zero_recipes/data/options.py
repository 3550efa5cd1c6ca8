"""The options that decide a dataset's rows, in one place.

`TokenizeOptions` is what turns one raw example into token ids and a label mask; `DataOptions` adds what
lays the tokenised examples out as rows. Both are read once from the `TrainConfig` (a dataset of a mixture
may set its own `format` and `text_column`), handed to the code that uses them, and hashed whole into the
cache keys: an option added here reaches `Tokenize`, the prepared-data cache key and the tokenisation
cache key with no other edit. Only options that change the rows belong here; anything else (workers,
batch sizes, the learning rate) must stay out, or it would needlessly invalidate the caches.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

# the per-dataset options: a mixture entry (a DatasetSpec) overrides these TrainConfig fields
PER_DATASET = {"format": "dataset_format", "text_column": "text_column"}


@dataclass(frozen=True)
class TokenizeOptions:
    """What `formats.Tokenize` reads: each one changes the ids, mask or hash of an example."""

    format: str  # as configured ("auto" allowed) until `DataOptions.resolved` gives the detected one
    text_column: str
    train_on_prompt: bool
    fix_text: bool
    strip_html: bool
    normalize_whitespace: bool
    drop_garbled: bool
    quality_filter: str
    dedupe: str  # none | exact | near: exact adds a hash per example, near a MinHash signature


@dataclass(frozen=True)
class DataOptions:
    """Everything besides the data itself and the tokenizer that decides the prepared rows."""

    tokenize: TokenizeOptions
    block_size: int
    packing: bool
    min_document_tokens: int
    dedupe_threshold: float  # read when the signatures are matched, so tokenisation's cache ignores it
    validation_split_percentage: float
    seed: int

    @classmethod
    def from_config(cls, cfg, spec=None) -> DataOptions:
        """Each field is the TrainConfig field of the same name, except the per-dataset ones, which
        come from `spec` (a `sources.DatasetSpec`) when given."""

        def value(name):
            if name in PER_DATASET:
                return getattr(spec, name) if spec is not None else getattr(cfg, PER_DATASET[name])
            return getattr(cfg, name)

        tokenize = TokenizeOptions(**{f.name: value(f.name) for f in fields(TokenizeOptions)})
        rest = {f.name: value(f.name) for f in fields(cls) if f.name != "tokenize"}
        return cls(tokenize=tokenize, **rest)

    def resolved(self, fmt: str) -> DataOptions:
        """These options with the format detected from the columns in place of the configured one."""
        return replace(self, tokenize=replace(self.tokenize, format=fmt))
