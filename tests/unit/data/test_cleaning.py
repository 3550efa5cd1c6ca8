"""Each cleaning step on small fixtures, in English and Chinese: what it repairs, what it drops and why, and
what it must leave alone (clean prose in either script, Chinese punctuation, code)."""

from __future__ import annotations

import numpy as np
import pytest

from cleaning_samples import CODE, EN, ZH
from zero_recipes.data import cleaning, dedupe
from zero_recipes.data.scripts import unspaced


def test_scripts_are_told_apart():
    assert unspaced(ZH) and not unspaced(EN) and not unspaced(CODE)
    assert unspaced("これは日本語の文章です。") and not unspaced("한국어는 띄어쓰기를 합니다")  # Korean has spaces


@pytest.mark.parametrize("text", [EN, ZH])
def test_fix_text_repairs_mojibake_and_leaves_correct_text_alone(text):
    assert cleaning.fix_text(text.encode("utf-8").decode("latin-1")) == text
    if text is EN:  # Chinese read as cp1252 hits its 5 undefined bytes, and what they were is lost
        assert cleaning.fix_text(text.encode("utf-8").decode("cp1252")) == text
    # ftfy's defaults would turn “” into "" and ，into , : correct text, not mojibake
    quoted = "他说：“明天见。”She said “fine” — and left…"
    assert cleaning.fix_text(quoted) == quoted


@pytest.mark.parametrize("text", [EN, ZH, CODE])
def test_clean_prose_and_code_are_kept(text):
    assert cleaning.drop_reason(text, garbled=True, quality="gopher") == ""


def test_each_kind_of_garbled_text_is_named():
    rng = np.random.default_rng(0)
    noise = bytes(rng.integers(0, 256, 2000, dtype=np.uint8)).decode("latin-1")
    chinese_as_mojibake = ZH.encode("utf-8").decode("gbk", errors="ignore")  # UTF-8 read as GBK: ftfy cannot undo it
    cases = {
        "replacement characters": EN.replace("e", "\ufffd"),
        "control characters": noise,
        "private-use or surrogate characters": "".join(chr(0xE000 + i % 500) for i in range(400)) + EN[:200],
        "mostly symbols": "=*=*=*=*|#|#|#| ~~~ >>> <<< :::::: ---- ++++ " * 20,
        "mojibake": EN.encode("utf-8").decode("cp1252", errors="replace").replace("The", "Thâ€™e"),
    }
    for why, text in cases.items():
        assert cleaning.garbled_reason(text) == f"garbled: {why}", why
    assert cleaning.fix_text(chinese_as_mojibake) != ZH
    assert cleaning.garbled_reason(chinese_as_mojibake) == "garbled: mojibake (rare Han characters)"
    assert cleaning.garbled_reason(ZH.encode("utf-8").decode("big5", errors="ignore")).startswith("garbled: mojibake")
    # a few stray replacement characters in a long document are not "dominated"
    assert cleaning.garbled_reason(EN.replace("maps", "ma\ufffds", 1)) is None


def test_quality_rules_judge_chinese_in_characters():
    # by datatrove's word rules a Chinese document is a handful of "words" (runs between punctuation)
    assert len(ZH.split()) < 50
    assert cleaning.quality_reason(ZH) is None
    spam_zh = "点击这里领取优惠券！" * 40
    spam_en = "click here for the best deals and the best prices " * 30
    assert cleaning.quality_reason(spam_zh).endswith("(judged in characters)")
    assert cleaning.quality_reason(spam_en).startswith("quality: ")
    assert cleaning.quality_reason("Too short to be a document.").startswith("quality: gopher_short_doc")


def edit_words(text, every):
    words = text.split(" ")
    return " ".join("changed" if i % every == 0 else w for i, w in enumerate(words))


def edit_chars(text, every):
    return "".join("改" if i % every == 0 and c not in "，。\n" else c for i, c in enumerate(text))


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_near_duplicates_are_found_in_either_script_and_distinct_documents_kept(lang):
    base, other = (EN, CODE) if lang == "en" else (ZH, ZH[::-1])
    edit = (lambda t: edit_words(t, 40)) if lang == "en" else (lambda t: edit_chars(t, 60))
    header = "Home | News | Contact\n\n" if lang == "en" else "首页 | 新闻 | 联系我们\n\n"
    paragraphs = base.split("\n\n")
    docs = [
        base,  # 0
        other,  # 1: unrelated
        edit(base),  # 2: a few words/characters changed
        header + base + "\n\nShare this article",  # 3: boilerplate added
        "\n\n".join(paragraphs[1:] + paragraphs[:1]),  # 4: paragraphs reordered
        base,  # 5: exact copy
    ]
    matched = dedupe.near(np.stack([dedupe.signature(t) for t in docs]), threshold=0.7)
    assert matched.tolist() == [-1, -1, 0, 0, 0, 0]
    assert dedupe.exact(np.array([cleaning.content_hash(t) for t in docs])).tolist() == [-1, -1, -1, -1, -1, 0]


def test_the_threshold_decides_how_near_is_a_duplicate():
    heavy = edit_words(EN, 8)  # one word in eight changed: about half the 5-word shingles differ
    sigs = np.stack([dedupe.signature(EN), dedupe.signature(heavy)])
    similarity = (sigs[0] == sigs[1]).mean()
    assert 0.2 < similarity < 0.6
    assert dedupe.near(sigs, threshold=0.7).tolist() == [-1, -1]
    assert dedupe.near(sigs, threshold=0.15).tolist() == [-1, 0]


def test_band_shape_finds_a_pair_at_the_threshold_with_probability_099():
    for t in (0.5, 0.7, 0.8, 0.9):
        bands, rows = dedupe.band_shape(t)
        assert bands * rows <= dedupe.NUM_HASHES
        assert 1 - (1 - t**rows) ** bands >= 0.99
        assert 1 - (1 - t ** (rows + 1)) ** (dedupe.NUM_HASHES // (rows + 1)) < 0.99  # the coarsest that does


def test_sft_examples_are_repaired_and_judged_on_their_words():
    row = {
        "messages": [
            {"role": "user", "content": "Whatâ€™s the time?"},
            {"role": "assistant", "content": "Itâ€™s noon."},
        ],
        "id": 7,
    }
    fixed = cleaning.fix_strings(row)
    assert fixed["messages"][1]["content"] == "It’s noon." and fixed["id"] == 7
    assert cleaning.example_text(fixed) == "What’s the time?\nIt’s noon."  # no roles, no template
