"""Data: sources (files, hub, saved, mixtures, streams), formats (text, prompt/completion, alpaca, chat)
with label masks, cleaning, packing, and a seeded resumable batch order. train.py and tools use only
the names below."""

from zero_recipes.data.preparation import Prepared, prepare  # noqa: F401

from .builtin import builtin_corpus_file, builtin_instructions_file, builtin_tokenizer_dir, load_tokenizer  # noqa: F401
from .cache import cache_root  # noqa: F401
from .options import DataOptions, TokenizeOptions  # noqa: F401
from .order import BatchOrder, Mixture, eval_batches  # noqa: F401
from .packing import Samples, collate, utilisation  # noqa: F401
from .sources import DatasetSpec, check, dataset_specs, describe  # noqa: F401
from .streaming import prepare_stream  # noqa: F401
