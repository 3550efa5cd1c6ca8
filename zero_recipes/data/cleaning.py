"""Per-document cleaning: repair (ftfy), garbled-text detection, and Gopher quality rules that know the
script they judge.

Each judge returns the reason a document is dropped, or None. They run inside the batched tokenisation map
(`formats.Tokenize`, one process per `--preprocessing_num_workers`), in `tools/clean_data.py` and in the
streaming reader, so the three agree on every document. Matching duplicates is `dedupe.py`'s; which scripts
are judged in characters is `scripts.py`'s.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from functools import lru_cache
from typing import Optional

import numpy as np

from ..errors import ConfigError
from . import dedupe
from .scripts import WORD_SPACED, WORD_UNSPACED, unspaced

# ---- edits ---------------------------------------------------------------------------------------------

_TAGS = re.compile(r"<(script|style)\b.*?</\1\s*>|<!--.*?-->|<[^>]+>", re.S | re.I)
_SPACES = re.compile(r"[ \t\f\v\r]+")
_BLANKS = re.compile(r"\n\s*\n+")


def strip_html(text: str) -> str:
    return html.unescape(_TAGS.sub(" ", text)) if "<" in text or "&" in text else text


def normalize_whitespace(text: str) -> str:
    return _BLANKS.sub("\n\n", _SPACES.sub(" ", text).replace(" \n", "\n").replace("\n ", "\n")).strip()


def content_hash(value) -> int:
    """63-bit hash of a text, or of an SFT example's fields, for exact dedupe."""
    data = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little") >> 1


# ---- repair --------------------------------------------------------------------------------------------


@lru_cache(1)
def _fixer_config():
    import ftfy

    # ftfy's defaults, except two that rewrite correct text: uncurl_quotes turns Chinese “” into "", and
    # fix_character_width folds full-width punctuation (，：) into ASCII. Neither repairs a decoding error.
    return ftfy.TextFixerConfig(uncurl_quotes=False, fix_character_width=False, explain=False)


def fix_text(text: str) -> str:
    """Mojibake (UTF-8 read as cp1252/latin-1, and mixtures), HTML entities in plain text, terminal
    escapes, C1 controls, broken surrogates and line breaks, repaired by ftfy."""
    import ftfy

    return ftfy.fix_text(text, _fixer_config())


# ---- garbled text ----------------------------------------------------------------------------------
# No library ships a "text no language produces" detector: ftfy measures mojibake, datatrove's filters
# assume words. So these are written here; each reason counts characters that real text in any script
# has almost none of, as a share of the document's non-space characters.

_REPLACEMENT = re.compile("\ufffd")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_PRIVATE_USE = re.compile("[\ue000-\uf8ff\U000f0000-\U000ffffd\U00100000-\U0010fffd\ud800-\udfff]")
_NON_SPACE = re.compile(r"\S")
_ALNUM = re.compile(r"[^\W_]")

GARBLED_CHAR_SHARE = 0.01  # replacement, control or private-use characters: more than 1 in 100
MIN_LETTER_SHARE = 0.5  # letters and digits: fewer than half the non-space characters is symbol noise
MOJIBAKE_PER_CHAR = 0.005  # ftfy's badness (mojibake-looking sequences) per character left after repair


def garbled_reason(text: str) -> Optional[str]:
    chars = len(_NON_SPACE.findall(text))
    if chars == 0:
        return None  # empty documents are --min_document_tokens' to drop
    for name, pattern in (
        ("replacement characters", _REPLACEMENT),
        ("control characters", _CONTROL),
        ("private-use or surrogate characters", _PRIVATE_USE),
    ):
        if len(pattern.findall(text)) > GARBLED_CHAR_SHARE * chars:
            return f"garbled: {name}"
    if len(_ALNUM.findall(text)) < MIN_LETTER_SHARE * chars:
        return "garbled: mostly symbols"
    import ftfy.badness

    if ftfy.badness.badness(text) > max(2, MOJIBAKE_PER_CHAR * chars):
        return "garbled: mojibake"
    han = _HAN.findall(text)
    if len(han) >= 20 and sum(not _common_han(c) for c in han) > RARE_HAN_SHARE * len(han):
        return "garbled: mojibake (rare Han characters)"
    return None


# UTF-8 read as GBK or Big5 gives valid Han characters, which ftfy's badness does not see, but mostly rare
# ones: measured on a news paragraph, 57 % (GBK) and 50 % (Big5) of them are outside the common sets below,
# against 0 % of the paragraph itself in simplified, traditional or Japanese writing.
_HAN = re.compile("[\u4e00-\u9fff]")
RARE_HAN_SHARE = 0.25
_COMMON_HAN = (  # the frequent-character blocks of each national encoding, as big-endian code ranges
    ("gb2312", 0xB0A1, 0xD7F9),  # GB 2312 level 1: the 3,755 most used simplified characters
    ("big5", 0xA440, 0xC67E),  # Big5's 5,401 frequently used traditional characters
    ("shift_jis", 0x889F, 0x9872),  # JIS X 0208 level 1: 2,965 common kanji
)


@lru_cache(maxsize=1 << 16)
def _common_han(ch: str) -> bool:
    for encoding, low, high in _COMMON_HAN:
        try:
            code = int.from_bytes(ch.encode(encoding), "big")
        except UnicodeEncodeError:
            continue
        if low <= code <= high:
            return True
    return False


# ---- quality (Gopher) --------------------------------------------------------------------------------
# datatrove's GopherQualityFilter and GopherRepetitionFilter, as the Gopher paper (Rae et al. 2021) and
# FineWeb use them, given words from `words()` instead of datatrove's spaCy tokenizers (a large download
# that this offline machine cannot make). For unspaced scripts the rules count characters: the word-length
# rules are off (a character is not a word), the length rule counts 100 characters where Gopher counts 50
# words, n-gram sizes double, and the stop words are function characters.

STOP_WORDS_LATIN = (
    "the be to of and that have with"  # Gopher's English list
    " der die das und ist nicht le la les et est pas el los que y en del il che di per non"
    " o os da em não de een het van en"
).split()
STOP_CHARS_UNSPACED = list("的了是在和有我不这也就都之其而或はをにがでと")


def _word_tokenizer(split):
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Words(WordTokenizer):
        def word_tokenize(self, text):
            return split(text)

        def sent_tokenize(self, text):
            return [text]

        def span_tokenize(self, text):
            return [(0, len(text))]

    return Words()


@lru_cache(2)
def gopher_filters(unspaced_script: bool):
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter

    if unspaced_script:
        split = WORD_UNSPACED.findall
        quality = GopherQualityFilter(
            min_doc_words=100,
            max_doc_words=200_000,
            min_avg_word_length=None,
            max_avg_word_length=None,
            stop_words=STOP_CHARS_UNSPACED,
            language=_word_tokenizer(split),
        )
        repetition = GopherRepetitionFilter(
            top_n_grams=((4, 0.2), (6, 0.18), (8, 0.16)),
            dup_n_grams=tuple((2 * n, f) for n, f in ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11))),
            language=_word_tokenizer(split),
        )
    else:
        split = WORD_SPACED.findall
        quality = GopherQualityFilter(stop_words=STOP_WORDS_LATIN, language=_word_tokenizer(split))
        repetition = GopherRepetitionFilter(language=_word_tokenizer(split))
    return quality, repetition


def quality_reason(text: str) -> Optional[str]:
    from datatrove.data import Document

    script = unspaced(text)
    doc = Document(text=text, id="")
    for f in gopher_filters(script):  # quality first: its reasons (too short, no stop words) say more
        verdict = f.filter(doc)
        if verdict is not True:
            why = verdict[1] if isinstance(verdict, tuple) else f.name
            return f"quality: {why}" + (" (judged in characters)" if script else "")
    return None


def drop_reason(text: str, garbled: bool, quality: str) -> str:
    """'' to keep `text`, else the first reason to drop it (garbled before quality)."""
    if garbled and (why := garbled_reason(text)):
        return why
    if quality == "gopher" and (why := quality_reason(text)):
        return why
    return ""


def fix_strings(value):
    """`fix_text` on every string inside an SFT example (lists and dicts of messages included)."""
    if isinstance(value, str):
        return fix_text(value)
    if isinstance(value, list):
        return [fix_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: fix_strings(v) for k, v in value.items()}
    return value


def example_text(row: dict) -> str:
    """The words of an SFT example, one string per line (message contents, not their roles), which the
    judges and near-duplicate shingles read: a chat template's markup would only make examples alike."""
    parts = []

    def walk(value):
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, dict):
            walk(value.get("content") if "role" in value else list(value.values()))
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(list(row.values()))
    return "\n".join(parts)


# the edits, in their order: (report name, function, the TokenizeOptions field that turns it on)
EDITS = (
    ("fix_text", fix_text, "fix_text"),
    ("html", strip_html, "strip_html"),
    ("whitespace", normalize_whitespace, "normalize_whitespace"),
)
EDIT_STEPS = tuple(name for name, _, _ in EDITS)


def check_format(opts, name: str) -> None:
    """What cleaning refuses once the data's format is known (`opts`: a resolved TokenizeOptions)."""
    if opts.quality_filter != "none" and opts.format != "text":
        raise ConfigError(
            f"--quality_filter {opts.quality_filter} judges web documents, and dataset '{name}' is "
            f"{opts.format} (SFT): its rules (50+ words, stop words) would drop most short answers; "
            "use --drop_garbled and --dedupe for SFT data"
        )


class Cleaner:
    """The cleaning steps `opts` (a TokenizeOptions) turns on, in their order: edits that rewrite a text
    (`fix_text`, then `strip_html` and `normalize_whitespace`), then judges that drop it."""

    def __init__(self, opts):
        self.opts = opts
        self.edits = [(name, fn) for name, fn, field in EDITS if getattr(opts, field)]
        self.judges = opts.drop_garbled or opts.quality_filter != "none"

    def edit(self, texts: list[str]) -> tuple[list[str], list[tuple[str, list[str], list[str], list[int]]]]:
        """`texts` after every edit that is on, and per edit (its name, the texts before and after it, the
        indices it changed), for the callers that count what each edit did."""
        steps = []
        for name, fn in self.edits:
            after = [fn(t) for t in texts]
            steps.append((name, texts, after, [i for i, (a, b) in enumerate(zip(texts, after)) if a != b]))
            texts = after
        return texts, steps

    def judge(self, texts: list[str], contents: list) -> dict:
        """What the steps after the edits read, per document, as the options ask: `drop`, why it is dropped
        ('' to keep it); `hash`, the exact hash of `contents` (a text or an SFT example's fields); `minhash`,
        the (n, NUM_HASHES) MinHash signatures of `texts`."""
        out = {}
        if self.judges:
            out["drop"] = [drop_reason(t, self.opts.drop_garbled, self.opts.quality_filter) for t in texts]
        if self.opts.dedupe == "exact":
            out["hash"] = np.array([content_hash(c) for c in contents], dtype=np.int64)
        elif self.opts.dedupe == "near":
            out["minhash"] = np.stack([dedupe.signature(t) for t in texts]).reshape(len(texts), dedupe.NUM_HASHES)
        return out
