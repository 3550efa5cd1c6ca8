"""Which scripts write words without spaces between them, and what a "word" is in each.

Chinese, Japanese, Thai, Lao, Khmer, Myanmar and Tibetan are written without spaces, so rules phrased in
words ("at least 50 words", 5-word shingles) count characters there: each such character is one word.
Everything else is split at spaces and punctuation.
"""

from __future__ import annotations

import re

UNSPACED = (
    "\u0e00-\u0eff"  # Thai, Lao
    "\u0f00-\u0fff"  # Tibetan
    "\u1000-\u109f"  # Myanmar
    "\u1780-\u17ff"  # Khmer
    "\u2e80-\u2fdf\u3005-\u3007\u3021-\u3029\u3040-\u30ff\u3100-\u312f\u31a0-\u31ff"  # radicals, kana, bopomofo
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"  # Han
)
_UNSPACED_CHAR = re.compile(f"[{UNSPACED}]")
_LETTER = re.compile(r"[^\W\d_]")
_UNSPACED_SHARE = 0.3  # a document this much in unspaced scripts (of its letters) is judged in characters


def unspaced(text: str) -> bool:
    """Whether words in `text` are not separated by spaces (mostly CJK, Thai, ...)."""
    letters = len(_LETTER.findall(text))
    return letters > 0 and len(_UNSPACED_CHAR.findall(text)) >= _UNSPACED_SHARE * letters


# "words" for rules phrased in words. Spaced scripts: what lies between spaces, punctuation attached, as the
# Gopher rules were written for. Unspaced: each such character, else a run of other letters/digits, else
# one punctuation or symbol character.
WORD_UNSPACED = re.compile(f"[{UNSPACED}]|[^\\W{UNSPACED}]+|[^\\w\\s]")
WORD_SPACED = re.compile(r"\S+")
