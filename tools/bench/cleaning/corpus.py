"""A labelled English + Chinese corpus for measuring a cleaning pipeline: near-duplicate detection (MinHash-LSH),
garbled-text detection, mojibake repair and quality filtering. `build(n, seed)` is deterministic for a given
(n, seed) and Python version; 100k documents take ~30-40 s on 2 cores.

Where the text comes from:
- English, real: the running Python's standard library (Python 3.11.7: ~154k words of prose kept): its
  docstrings (zero_recipes' built-in corpus, `stdlib_docstrings()`), its language reference (`pydoc_data.topics`)
  and the full-line comments of the same files; reST markup removed, lines unwrapped, only paragraphs that read
  as prose (stop words, closing punctuation, >= 80 % of tokens with a letter, counting punctuation as tokens).
  Their doctest examples are the occasional code snippets. That is too little for tens of thousands of distinct
  documents, so the text is cut into 5,091 units of 15-80 words laid on an m x m grid (m = 71, prime), and a
  document is a run of consecutive points on one line of that affine plane. The grid rows are the units in
  source order, so the first ~580 documents are coherent runs of real text; the other lines recombine units such
  that two documents share at most one unit (and no unit is over 40 % of a document). One plane gives ~42k
  documents (a 100k corpus draws ~36k); past that a shuffled copy of the grid is used, and the bound becomes
  statistical. Runs that would fail Gopher's repetition filter (sibling docstrings repeat each other) are skipped.
- English, synthetic decorations: datelines/bylines, URL, e-mail and number sentences, curly quotes and dashes.
- Chinese, all synthetic: offline Chinese prose is scarce (see zh_vocab.py), so documents are written
  from hand-made vocabulary and sentence templates: 10 topics x 3 registers (news, blog, guide), with titles,
  datelines, numbers, Latin words, URLs, phone numbers and e-mail addresses.
- Everything else (near-duplicates, boilerplate, garbling, mojibake) is derived by the code below.

Mix (of n): 60 % clean, 20 % near_dup (edit/boilerplate/reorder/date), 5 % exact_dup, 10 % garbled (6
variants), 5 % mojibake_fixable; half English, half Chinese in every kind. Duplicates come after their
source; mojibake_fixable originals are not in the corpus (repaired, they are documents to keep). "Repaired"
means `ftfy.fix_encoding(text) == original`: `ftfy.fix_text` also uncurls quotes and turns Chinese full-width
punctuation into ASCII, so it changes even the original (fix_text(text) == fix_text(original) holds).

    python tools/bench/cleaning/corpus.py --n 1000 --seed 0 --out /tmp/corpus.jsonl [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sysconfig
import textwrap
import time
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path

try:
    from . import zh_vocab as zh
except ImportError:  # run as a script: tools/bench/cleaning is on sys.path, not tools/
    import zh_vocab as zh


@lru_cache(maxsize=None)
def _ftfy():
    """ftfy, imported when a corpus is built or checked, not with this module: `benchmark.py --help` and the
    other benchmarks run where it is not installed (the GPU machine). Its bad_codecs registers
    sloppy-windows-1252, which maps every byte (cp1252 leaves 5 out)."""
    import ftfy
    import ftfy.bad_codecs  # noqa: F401

    return ftfy


NEAR = ("edit", "boilerplate", "reorder", "date")
GARBLED = ("replacement", "control", "private_use", "binary", "mojibake_unfixable", "symbols")
MIX = (
    {("near_dup", v): 0.05 for v in NEAR}
    | {("exact_dup", ""): 0.05, ("mojibake_fixable", ""): 0.05}
    | {("garbled", v): 0.10 / 6 for v in GARBLED}
)

# ---- English: real units on an affine plane -------------------------------------------------------------

STOP = frozenset("the and of to a an in is that it for with be as this are or by on if not from which".split())
MARKUP = re.compile(r":[\w:]+:`~?([^`<]*?)(?: <[^>]*>)?`|``([^`]*)``|\*\*?(\w[^*]*?)\*\*?|`([^`]*)`")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
TOKEN = re.compile(r"\w+(?:'\w+)?|[^\w\s]")
COMMENT_BLOCK = re.compile(r"(?:^[ \t]*#[^\n]*\n)+", re.M)
SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip", "turtledemo"}


def _prose(p: str) -> bool:
    """A paragraph a reader would call prose: words, stop words, closing punctuation, little markup left. The
    share of tokens with a letter counts punctuation as tokens, as Gopher filters with a word tokenizer do."""
    w, tokens = p.split(), TOKEN.findall(p)
    return (
        len(w) >= 6
        and sum(any(c.isalpha() for c in x) for x in tokens) >= 0.8 * len(tokens)
        and sum(x.lower() in STOP for x in w) >= 0.08 * len(w)
        and p[0].isupper()
        and p.endswith((".", "?", "!", ")", '"'))
        and sum(p.count(c) for c in "`*_|{}[]<>=\\#@$~^") <= 0.02 * len(p)
    )


def _stdlib_comments() -> list[str]:
    """The full-line comment blocks of the files stdlib_docstrings() reads (same SKIP), '#' removed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    blocks = []
    for path in sorted(root.rglob("*.py")):
        if not SKIP.intersection(path.relative_to(root).parts):
            text = path.read_text(encoding="utf-8", errors="replace")
            blocks += [re.sub(r"(?m)^[ \t]*#+ ?", "", b) for b in COMMENT_BLOCK.findall(text)]
    return blocks


@lru_cache(maxsize=1)
def _english_units() -> tuple[list[str], list[str]]:
    """(units of 15-80 words in source order, doctest snippets); a unit that begins or ends with the same 10
    words as an earlier one is left out."""
    import pydoc_data.topics

    from zero_recipes.data.builtin import stdlib_docstrings

    units, snippets, buf, seen = [], [], [], set()
    for src in stdlib_docstrings() + list(pydoc_data.topics.topics.values()) + _stdlib_comments():
        for para in re.split(r"\n\s*\n", src):
            lines = textwrap.dedent(para.strip("\n")).split("\n")
            if lines[0].startswith(">>>"):
                if 2 <= len(lines) <= 6 and max(map(len, lines)) <= 72:
                    snippets.append("\n".join(lines))
                continue
            if any(line[:1] in " \t" for line in lines):  # hanging indents: argument lists, grammar, code
                continue
            p = MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), " ".join(lines))
            p = re.sub(r"\s+", " ", p).strip()
            p = p if p.startswith(("http", "www.")) else p[:1].upper() + p[1:]  # "Path is ...", not "Https://"
            if not _prose(p):
                continue
            for sent in SENTENCE_END.split(p) if len(p.split()) > 80 else [p]:
                buf.append(sent)  # short paragraphs and sentences merge (across docstrings too) until 15 words
                if sum(len(s.split()) for s in buf) >= 15:
                    unit = " ".join(buf)
                    words = re.sub(r"[^\w\s]+", "", unit.lower()).split()
                    keys = {"^" + " ".join(words[:10]), "$" + " ".join(words[-10:])}
                    if len(words) <= 80 and not keys & seen:  # sibling docstrings and licence headers repeat
                        units.append(unit)
                        seen |= keys
                    buf = []
    return units, snippets


def _repetitive(text: str) -> bool:
    """Gopher's duplicate word n-gram test (n = 5..10: at most 15..10 % of the characters in repeats), 2 points
    stricter. Repeated 10-grams imply repeated 5-grams, so a text with few of the latter passes at once."""
    words = TOKEN.findall(text)  # punctuation a token of its own, as a word tokenizer makes it
    for n, limit in zip(range(5, 11), (0.13, 0.12, 0.11, 0.10, 0.09, 0.08)):
        grams = list(zip(*(words[k:] for k in range(n))))
        if len(set(grams)) == len(grams):
            return False
        seen, dup, i = set(), 0, 0
        while i < len(grams):
            gram = grams[i]
            if gram in seen:
                dup, i = dup + sum(map(len, gram)), i + n
            else:
                seen.add(gram)
                i += 1
        if dup > limit * len(text):
            return True
        if dup <= 0.08 * len(text):
            return False
    return False


class _EnglishDocs:
    """Documents as runs of units along the lines of an affine plane over Z_m: two lines meet in at most one
    point, so two documents share at most one unit. Lines y = s*x + b (s = m: the vertical x = b); s = 0 are
    the grid rows, i.e. consecutive source text, and come first."""

    def __init__(self, rng: random.Random):
        self.units, self.snippets = _english_units()
        self.m = max(p for p in range(2, math.isqrt(len(self.units)) + 1) if all(p % q for q in range(2, p)))
        self.words = [len(u.split()) for u in self.units]
        self.rng, self.perm, self.pending = rng, list(range(self.m * self.m)), []
        self.lines = self._plane()

    def _plane(self):
        m = self.m
        rows, others = [(0, b) for b in range(m)], [(s, b) for s in range(1, m + 1) for b in range(m)]
        self.rng.shuffle(rows)
        self.rng.shuffle(others)
        for s, b in rows + others:
            pts = [b + y * m for y in range(m)] if s == m else [((s * x + b) % m) * m + x for x in range(m)]
            r = self.rng.randrange(m)  # where the run starts: chunk boundaries differ between seeds
            yield [self.perm[i] for i in pts[r:] + pts[:r]]

    def _target(self) -> int:
        return int(min(500, max(80, self.rng.lognormvariate(math.log(200), 0.5))))

    def next(self) -> list[str]:
        while not self.pending:
            line = next(self.lines, None)
            if line is None:  # plane used up: a shuffled grid; from here the one-shared-unit bound is statistical
                self.rng.shuffle(self.perm)
                self.lines = self._plane()
                continue
            cur, words, target = [], 0, self._target()
            for u in line:
                cur.append(u)
                words += self.words[u]
                if words >= target and len(cur) >= 3 and max(self.words[i] for i in cur) <= 0.4 * words:
                    units = [self.units[i] for i in cur]
                    if not _repetitive(" ".join(units)):  # sibling docstrings can repeat each other
                        self.pending.append(units)
                    cur, words, target = [], 0, self._target()
        return self.pending.pop(0)


FIRST = "James Mary Robert Linda Michael Sarah David Emma Daniel Olivia Thomas Priya Wei Ahmed Sofia Lucas".split()
LAST = "Smith Johnson Brown Garcia Miller Davis Lopez Wilson Taylor Clark Nguyen Patel Kim Müller Rossi Silva".split()
MONTHS = "January February March April May June July August September October November December".split()
EN_DATELINES = ["Published {d} {M} {y} by {name}", "Posted on {M} {d}, {y}", "By {name} | {M} {d}, {y}",
                "Last updated: {y}-{m:02d}-{d:02d}"]  # fmt: skip
EN_UPDATED = ["Updated {d} {M} {y}", "Last modified on {M} {d}, {y} by {name}", "Revised: {y}-{m:02d}-{d:02d}"]
EN_NOISE = ["The full reference is at https://docs.python.org/3/library/{mod}.html.",
            "A related bug report is https://github.com/python/cpython/issues/{n}.",
            "Questions can be sent to {first}.{last}@{dom} or to the mailing list.",
            "In our tests this took {n} ms on a laptop, about {p}% faster than before."]  # fmt: skip
EN_BOILER = ["Skip to main content", "Home › Docs › Library reference", "Menu  Home  About  Blog  Contact",
             "Share this article: Facebook · Twitter · LinkedIn · Email", "Back to top ↑", "Comments are closed.",
             "We use cookies to give you the best experience. By continuing, you agree to our Cookie Policy.",
             "© {y} Example Media Group. All rights reserved.", "Subscribe to our newsletter for weekly updates.",
             "Tags: python, programming, tutorial", "Related posts", "Print this page"]  # fmt: skip
MODS = "os re json email asyncio logging socket typing pathlib sqlite3 decimal unittest collections zipfile".split()
DOMAINS = "python.org gmail.com example.org university.edu mail.com".split()
FILLER = "the a of and to in that is this also only then new which it not all can some more each other".split()


def _en_fill(tpl: str, rng: random.Random) -> str:
    m, name = rng.randint(1, 12), f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    y, first, last = rng.randint(2005, 2024), rng.choice(FIRST).lower(), rng.choice(LAST).lower().replace("ü", "u")
    d, n, p, mod, dom = (
        rng.randint(1, 28),
        rng.randint(2, 99999),
        rng.randint(2, 60),
        rng.choice(MODS),
        rng.choice(DOMAINS),
    )
    return tpl.format(d=d, m=m, M=MONTHS[m - 1], y=y, name=name, mod=mod, n=n, p=p, first=first, last=last, dom=dom)


def _typography(text: str) -> str:
    """Curly apostrophes and quotes and em dashes, as published web text has (and mojibake needs)."""
    text = re.sub(r"(?<=\w)'(?=\w)", "’", text)
    text = re.sub(r'"([^"\n]{1,60})"', r"“\1”", text)
    return text.replace(" -- ", " — ")


def _group(items: list[str], rng: random.Random, sep: str, most: int) -> list[str]:
    """Split items into 2..most contiguous paragraphs."""
    p = rng.randint(2, min(most, len(items)))
    cuts = [0, *sorted(rng.sample(range(1, len(items)), p - 1)), len(items)]
    return [sep.join(items[a:b]) for a, b in zip(cuts, cuts[1:])]


def _zh_paragraphs(sents: list[str], rng: random.Random, most: int) -> list[str]:
    """2..most paragraphs of ~70+ characters, each over 30 (FineWeb's filter drops pages of short lines)."""
    size = sum(map(len, sents))
    p = rng.randint(2, max(2, min(most, size // 70)))
    out = [[]]
    for s in sents:
        done = sum(map(len, out[-1]))
        if len(out) < p and done > 30 and done >= size / p * rng.uniform(0.6, 1.4):
            out.append([])
        out[-1].append(s)
    if len(out) > 2 and sum(map(len, out[-1])) <= 30:
        last = out.pop()
        out[-1] += last
    if len(out) == 1:
        out = [out[0][: len(sents) // 2], out[0][len(sents) // 2 :]]
    return ["".join(x) for x in out]


def _english(src: _EnglishDocs, rng: random.Random) -> dict:
    """A document: head (lines above the article: title, dateline) and body (its paragraphs); 2-8 blocks."""
    head = [_en_fill(rng.choice(EN_DATELINES), rng)] if rng.random() < 0.45 else []
    snippet = rng.choice(src.snippets) if rng.random() < 0.06 else ""
    body = _group(src.next(), rng, " ", 8 - len(head) - bool(snippet))
    if rng.random() < 0.12:  # URLs, e-mail addresses, numbers: noise a cleaner must keep
        body[rng.randrange(len(body))] += " " + _en_fill(rng.choice(EN_NOISE), rng)
    if rng.random() < 0.3:
        body = [_typography(p) for p in body]
    tokens = TOKEN.findall(" ".join(head + body + [snippet])) if snippet else []
    if snippet and sum(any(c.isalpha() for c in t) for t in tokens) >= 0.82 * len(tokens):  # stays prose
        body.insert(rng.randint(1, len(body)), snippet)
    return {"lang": "en", "head": head, "body": body, "dateline": 0 if head else -1}


# ---- Chinese: templates --------------------------------------------------------------------------------


# The generated slots (names, numbers, dates, addresses): (rng.randint, rng.choice, pools) -> str
ZH_VALUES = {
    "who": lambda r, c, p: c(p["sur"]) + c(p["given"]),
    "num": lambda r, c, p: str(r(2, 99)), "d1": lambda r, c, p: str(r(1, 9)),
    "big": lambda r, c, p: c((f"{r(1, 99)}.{r(1, 9)}万", f"{r(12, 980)}0", f"{r(1, 30)}.{r(1, 9)}亿")),
    "pct": lambda r, c, p: c((str(r(2, 40)), f"{r(1, 30)}.{r(1, 9)}")),
    "y": lambda r, c, p: str(r(2012, 2024)), "mo": lambda r, c, p: str(r(1, 12)), "day": lambda r, c, p: str(r(1, 28)),
    "mo2": lambda r, c, p: f"{r(1, 12):02d}", "day2": lambda r, c, p: f"{r(1, 28):02d}",
    "hh": lambda r, c, p: f"{r(6, 22):02d}", "mi": lambda r, c, p: f"{r(0, 59):02d}",
    "lat": lambda r, c, p: c(p["lat0"]),
    "url": lambda r, c, p: f"https://www.{c(p['pinyin'])}.gov.cn/{r(2015, 2024)}/{r(1000, 99999)}.html",
    "mail": lambda r, c, p: f"{c(p['pinyin'])}{r(1, 999)}@{c(p['maild'])}",
    "tel": lambda r, c, p: c((f"0{r(10, 999)}-{r(2000, 8999)}{r(1000, 9999)}", f"400-{r(100, 999)}-{r(1000, 9999)}")),
}  # fmt: skip


class _Chinese:
    """Sentences filled from cleaning_zh_vocab: each template is pre-split into literal and slot pieces."""

    def __init__(self):
        split = lambda tpls: [re.split(r"\{(\w+)\}", t) for t in tpls]  # noqa: E731  odd pieces are slot names
        self.general, self.titles = split(zh.TEMPLATES), split(zh.TITLES)
        self.registers = {k: split(v) for k, v in zh.REGISTERS.items()}
        self.datelines = {k: split(v) for k, v in zh.DATELINES.items()}
        self.updated, self.boiler = split(zh.DATELINE_UPDATED), split(zh.BOILERPLATE)
        self.topics = {k: (split(v["tpl"]), zh.COMMON | {s: w for s, w in v.items() if s != "tpl"})
                       for k, v in zh.TOPICS.items()}  # fmt: skip
        self.chars = sorted({c for t in zh.TOPICS.values() for w in t["n"] + t["x"] for c in w if "一" <= c <= "鿿"})
        every = [p for ps in (self.general, self.titles, *self.registers.values()) for p in ps]
        for tpls, pools in self.topics.values():  # a typo in the vocabulary fails here, not mid-corpus
            for pieces in every + tpls:
                self.fill(pieces, pools, random.Random(0))

    def fill(self, pieces: list[str], pools: dict, rng: random.Random) -> str:
        out, r = [], rng.randint
        for i, p in enumerate(pieces):
            out.append(p if i % 2 == 0 else rng.choice(pools[p]) if p in pools else ZH_VALUES[p](r, rng.choice, pools))
        return "".join(out)

    def doc(self, rng: random.Random) -> dict:
        tpls, pools = self.topics[rng.choice(sorted(self.topics))]
        reg = rng.choices(("news", "blog", "guide"), (5, 3, 2))[0]
        head = [self.fill(rng.choice(self.titles), pools, rng)] if rng.random() < 0.5 else []
        dateline = len(head) if rng.random() < {"news": 0.7, "blog": 0.4, "guide": 0.3}[reg] else -1
        if dateline >= 0:
            head.append(self.fill(rng.choice(self.datelines[reg]), pools, rng))
        target = min(1080, max(160, rng.lognormvariate(math.log(420), 0.55)))
        decks = [[], [], []]  # templates are drawn without replacement: a page does not repeat its sentences
        sents, size = [], 0
        while size < target or len(sents) < 2:
            pick = rng.random()
            k = 0 if pick < 0.35 else 1 if pick < 0.55 else 2
            pool = (tpls, self.registers[reg], self.general)[k]
            decks[k] = decks[k] or rng.sample(pool, len(pool))
            sents.append(self.fill(decks[k].pop(), pools, rng))
            size += len(sents[-1])
        while size > 1080 and len(sents) > 2:
            size -= len(sents.pop())
        body = _zh_paragraphs(sents, rng, 8 - bool(head))
        if rng.random() < 0.06:
            body[-1] += f"（原文链接：{ZH_VALUES['url'](rng.randint, rng.choice, pools)}）"
        return {"lang": "zh", "head": head, "body": body, "dateline": dateline, "pools": pools}


# ---- near-duplicates -----------------------------------------------------------------------------------


def _edit(doc: dict, rng: random.Random, zh_chars: list[str]) -> str:
    """Substitute, insert or delete at random positions: 3-8 % of English words; for Chinese, word-sized
    (1-2 character) edits at 1.5-3.5 % of characters, ~3-7 % of its words: each edit there breaks 5-6 of the
    5-gram shingles, so a higher rate would not leave a near-duplicate."""
    text = _text(doc)
    if doc["lang"] == "en":
        words = [p.split(" ") for p in text.split("\n\n")]
        spots = [(i, j) for i, ws in enumerate(words) for j in range(len(ws))]
        for i, j in sorted(rng.sample(spots, max(1, round(len(spots) * rng.uniform(0.03, 0.08)))), reverse=True):
            op = rng.random()
            if op < 0.5:
                words[i][j] = rng.choice(FILLER)
            elif op < 0.75:
                words[i].insert(j, rng.choice(FILLER))
            elif len(words[i]) > 1:
                del words[i][j]
        return "\n\n".join(" ".join(ws) for ws in words)
    chars = list(text)
    spots = [i for i, c in enumerate(chars) if "一" <= c <= "鿿"]
    for i in sorted(rng.sample(spots, max(1, round(len(spots) * rng.uniform(0.015, 0.035)))), reverse=True):
        op, n = rng.random(), rng.choice((1, 2))
        if op < 0.5:
            chars[i : i + n] = rng.choices(zh_chars, k=n)
        elif op < 0.75:
            chars[i:i] = rng.choices(zh_chars, k=n)
        else:
            del chars[i : i + n]
    return "".join(chars)


def _boilerplate(doc: dict, rng: random.Random, zhg: _Chinese) -> str:
    """Site header/footer lines around the same article: 5-15 % of its length, at least one line."""
    text = _text(doc)
    if doc["lang"] == "en":
        pieces = [_en_fill(t, rng) for t in EN_BOILER]
    else:
        pieces = [zhg.fill(p, doc["pools"], rng) for p in zhg.boiler]
    rng.shuffle(pieces)
    budget, top, bottom = rng.uniform(0.05, 0.15) * len(text), [], []
    for p in sorted(pieces, key=len)[:1] + pieces:
        if len(p) + 1 <= budget or not top + bottom:
            (top if rng.random() < 0.5 else bottom).append(p)
            budget -= len(p) + 1
    return "\n".join(top + [text] + bottom)


def _reorder(doc: dict, rng: random.Random) -> str:
    head, body = doc["head"], list(doc["body"])
    if rng.random() < 0.5:
        i, j = rng.sample(range(len(body)), 2)
        body[i], body[j] = body[j], body[i]
    else:
        k = rng.randint(1, len(body) - 1)
        body = body[k:] + body[:k]
    return _text({"head": head, "body": body})


def _redate(doc: dict, rng: random.Random, zhg: _Chinese) -> str:
    """A later edition of the page: the dateline becomes an 'updated' one and one to three figures change."""
    if doc["lang"] == "en":
        new = _en_fill(rng.choice(EN_UPDATED), rng)
    else:
        new = zhg.fill(rng.choice(zhg.updated), doc["pools"], rng)
    body = "\n\n".join(doc["body"])
    spans = [m.span() for m in re.finditer(r"\d+", body)]
    for a, b in sorted(rng.sample(spans, min(len(spans), rng.randint(1, 3))), reverse=True):
        body = body[:a] + "".join(str(rng.randint(1, 9)) for _ in range(b - a)) + body[b:]
    head = list(doc["head"])
    if doc["dateline"] >= 0:
        head[doc["dateline"]] = new
    else:
        head.append(new)
    return _text({"head": head, "body": [body]})


# ---- garbled text and mojibake ----------------------------------------------------------------------------

CONTROL = [chr(c) for c in [*range(9), 11, 12, *range(14, 32), *range(0x7F, 0xA0)]]
NO_CONTROL = dict.fromkeys(map(ord, CONTROL))
MAGIC = [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"PK\x03\x04\x14\x00\x06\x00\x08\x00", b"\x7fELF\x02\x01\x01\x00",
         b"%PDF-1.5\n%\xe2\xe3\xcf\xd3\n4 0 obj\n<< /Filter /FlateDecode /Length 1843 >>\nstream\n",
         b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01", b"GIF89a\x01\x00\x01\x00", b""]  # fmt: skip
SYMBOLS = "═ ─ │ ║ ★ ☆ ♥ ♦ ♣ ♠ ● ○ ■ □ ▲ △ ◆ ◇ → ← ↑ ↓ ※ § ✓ ✗ ✦ ♪ ♫ 😀 😂 🔥 💯 👍 🎉 ✨ 🌟 💰 👉".split() + list(
    "!?*#=-~+.|/<>^_"
)
SPAM = {
    "en": "SALE FREE WIN click now BEST deal bonus hot VIP".split(),
    "zh": "限时 特惠 点击 免费 领取 爆款 秒杀 福利 包邮 抢购".split(),
}
TYPO = frozenset("“”‘’—–…•°€£©®×·›↑")


def _strings(x) -> list[str]:
    return [x] if isinstance(x, str) else [s for v in (x.values() if isinstance(x, dict) else x) for s in _strings(v)]


ZH_OK = frozenset("，。、；：“”‘’？！（）《》【】…—·％～") | {
    c for s in _strings([v for k, v in vars(zh).items() if k.isupper()]) for c in s if c >= "一"
}


def garble_score(text: str, lang: str) -> float:
    """Share of non-space characters that the language's clean text never has (ASCII, typography, accented
    Latin for English; the generator's characters and Chinese punctuation for Chinese). 0 on clean text."""
    chars = [c for c in text if not c.isspace()]
    native = (lambda c: c in ZH_OK) if lang == "zh" else (lambda c: "À" <= c <= "ſ" and c.isalpha())
    return 1 - sum(" " < c <= "~" or c in TYPO or native(c) for c in chars) / len(chars) if chars else 0.0


def label_share(variant: str, text: str) -> float:
    """What the garbled variant is made of, as a share of the text: U+FFFD (replacement), C0/C1 controls (control),
    private-use characters among the non-space ones (private_use). The labels promise >= 0.1, 0.1 and 0.5."""
    if variant == "private_use":
        chars = [c for c in text if not c.isspace()]
        return sum("\ue000" <= c <= "\uf8ff" for c in chars) / max(1, len(chars))
    bad = text.count("\ufffd") if variant == "replacement" else len(text) - len(text.translate(NO_CONTROL))
    return bad / max(1, len(text))


SHARE_AT_LEAST = {"replacement": 0.1, "control": 0.1, "private_use": 0.5}


def _garble(variant: str, text: str, lang: str, rng: random.Random) -> str:
    if variant == "replacement":
        if lang == "zh" and rng.random() < 0.5:  # a GBK page read as UTF-8, the usual way Chinese becomes �
            return text.encode("gbk", errors="replace").decode("utf-8", errors="replace")
        data = bytearray(text.encode())
        for i in rng.sample(range(len(data)), int(len(data) * rng.uniform(0.15, 0.3) / (1 + 2 * (lang == "zh")))):
            data[i] = rng.randrange(0x80, 0x100)  # a lone high byte: each hit spoils one (Chinese: 3-byte) character
        return data.decode("utf-8", errors="replace")
    if variant == "control":
        if lang == "en" and rng.random() < 0.5:  # UTF-16 read as UTF-8: a NUL after every character
            return text.encode("utf-16-le").decode("utf-8", errors="replace")
        cuts = sorted(rng.sample(range(len(text) + 1), int(len(text) * rng.uniform(0.15, 0.5))))
        junk = rng.choices(CONTROL, k=len(cuts))
        return "".join(text[a:b] + c for a, b, c in zip([0, *cuts], cuts, junk)) + text[cuts[-1] if cuts else 0 :]
    if variant == "private_use":  # a PDF font without a Unicode map: each glyph a private-use code point
        a, b = rng.randrange(1, 6400, 2), rng.randrange(6400)
        a += a % 5 == 0 and 2  # a coprime with 6400 = 2^8 * 5^2: distinct letters stay distinct
        return "".join(chr(0xE000 + (ord(c) * a + b) % 6400) if c.isalpha() else c for c in text)
    if variant == "binary":
        data = rng.choice(MAGIC) + rng.randbytes(rng.randint(300, 3000))
        return data.decode(rng.choice(("latin-1", "sloppy-windows-1252")))
    if variant == "symbols":  # banner spam and ASCII art: symbol runs, a few words
        tok = lambda: rng.choice(SPAM[lang]) if rng.random() < 0.15 else rng.choice(SYMBOLS) * rng.randint(1, 8)  # noqa: E731
        return "\n".join(" ".join(tok() for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(6, 30)))
    if lang == "en":  # mojibake_unfixable
        if rng.random() < 0.5:  # ASCII read as UTF-16 ("Bush hid the facts"): CJK-looking noise
            data = text.encode()
            return (data + b" " * (len(data) % 2)).decode(rng.choice(("utf-16-le", "utf-16-be")), errors="replace")
        return text.encode("cp037", errors="replace").decode("sloppy-windows-1252")  # EBCDIC read as Windows-1252
    if rng.random() < 0.5:  # UTF-8 read as GBK: 鍙戝竷-style characters no reader can place
        return text.encode().decode("gbk", errors="replace")
    drop = rng.uniform(0.08, 0.15)  # UTF-8 read as Windows-1252, then bytes lost: the sequences no longer decode
    return "".join(c for c in text.encode().decode("sloppy-windows-1252") if rng.random() >= drop)


def _mojibake(text: str, rng: random.Random) -> str | None:
    """Classic mojibake that ftfy undoes exactly (UTF-8 read as Windows-1252 or Latin-1, once or twice)."""
    ftfy = _ftfy()
    for how in rng.sample(("sloppy-windows-1252", "latin-1", "twice"), 3):
        once = text.encode().decode("sloppy-windows-1252" if how == "twice" else how)
        bad = once.encode().decode("sloppy-windows-1252") if how == "twice" else once
        if ftfy.fix_encoding(bad) == text:
            return bad
    return None


def _curly(text: str, rng: random.Random) -> str:
    """English with enough non-ASCII for its mojibake to show: curly quotes, plus scare quotes if needed."""
    text = _typography(text)
    words, missing = text.split(" "), 6 - (len(text) - len(text.encode("ascii", "ignore")))
    while missing > 0:
        i = rng.randrange(len(words))
        if words[i].isalpha():
            words[i], missing = f"“{words[i]}”", missing - 2
    return " ".join(words)


# ---- the corpus ----------------------------------------------------------------------------------------


def _text(doc: dict) -> str:
    return "\n\n".join((["\n".join(doc["head"])] if doc["head"] else []) + doc["body"])


@lru_cache(maxsize=1)
def _chinese() -> _Chinese:
    return _Chinese()


def _plan(n: int) -> list[tuple[str, str, str]]:
    """(kind, variant, lang) per document, clean ones first: MIX's shares of n, the rest clean, each split
    evenly between the languages (an odd count's extra document alternates)."""
    counts = {k: round(n * f) for k, f in MIX.items()}
    plan, odd = [], 0
    for (kind, variant), c in ({("clean", ""): n - sum(counts.values())} | counts).items():
        en = c // 2 + (c % 2 and odd % 2 == 0)
        odd += c % 2
        plan += [(kind, variant, "en")] * en + [(kind, variant, "zh")] * (c - en)
    return plan


def _duplicate(kind: str, variant: str, lang: str, docs: list, eligible: dict, rng: random.Random) -> dict:
    if (lang, variant) not in eligible:  # all clean documents exist by now: the plan puts them first
        ids = [i for i, d in enumerate(docs) if d["kind"] == "clean" and d["lang"] == lang]
        if variant == "reorder":
            ids = [i for i in ids if len(docs[i]["body"]) >= 3] or ids
        if variant == "date":  # a dated page, long enough that a new dateline leaves a near-duplicate
            ids = [i for i in ids if docs[i]["dateline"] >= 0 and len(docs[i]["text"]) >= 400] or ids
        eligible[lang, variant] = ids
    zhg, text, s = _chinese(), "", -1
    while s < 0 or (text == docs[s]["text"]) != (kind == "exact_dup"):  # a near-duplicate that came out unchanged
        s = rng.choice(eligible[lang, variant])
        src = docs[s]
        text = {
            "": lambda: src["text"],
            "edit": lambda: _edit(src, rng, zhg.chars),
            "boilerplate": lambda: _boilerplate(src, rng, zhg),
            "reorder": lambda: _reorder(src, rng),
            "date": lambda: _redate(src, rng, zhg),
        }[variant]()
    return {"text": text, "lang": lang, "kind": kind, "variant": variant, "source": s}


def _derived(kind: str, variant: str, lang: str, fresh, rng: random.Random) -> dict:
    """A garbled or mojibake document from a new text (not in the corpus), retried until it is what its label
    says: >= 10 % U+FFFD / control characters, mojibake that ftfy restores exactly or cannot restore at all."""
    for _ in range(50):
        original = "" if variant in ("binary", "symbols") else _text(fresh(lang))
        if kind == "mojibake_fixable":
            original = _curly(original, rng) if lang == "en" else original
            text = _mojibake(original, rng)
        else:
            text = _garble(variant, original, lang, rng)
        if text is None or text == original:
            continue
        if variant in SHARE_AT_LEAST and label_share(variant, text) < SHARE_AT_LEAST[variant]:
            continue
        if variant == "mojibake_unfixable":
            fixed = _ftfy().fix_text(text)
            if original in (fixed, _ftfy().fix_encoding(text)) or garble_score(fixed, lang) < 0.3:
                continue
        doc = {"text": text, "lang": lang, "kind": kind, "variant": variant, "source": -1}
        return doc | {"original": original}  # what it was before garbling: scores a repair as a repair
    raise RuntimeError(f"could not make a {kind}/{variant} document")


def build(n_docs: int, seed: int = 0, originals: bool = False) -> list[dict]:
    """n_docs labelled documents, each {"text", "lang": "en"|"zh", "kind", "variant", "source"}; see the module
    docstring. originals=True adds "original" (the text before garbling) to garbled and mojibake documents."""
    _ftfy()  # its codecs, before any document is garbled
    rng, zhg = random.Random(seed), _chinese()
    english = _EnglishDocs(rng)
    fresh = lambda lang: _english(english, rng) if lang == "en" else zhg.doc(rng)  # noqa: E731
    docs, eligible = [], {}
    for kind, variant, lang in _plan(n_docs):
        if kind == "clean":
            d = fresh(lang)
            d.update(text=_text(d), kind=kind, variant=variant, source=-1)
        elif kind in ("near_dup", "exact_dup"):
            d = _duplicate(kind, variant, lang, docs, eligible, rng)
        else:
            d = _derived(kind, variant, lang, fresh, rng)
        docs.append(d)
    # Shuffle, then swap each source with its earliest duplicate if that one came first: only the pair moves
    pos = list(range(len(docs)))
    rng.shuffle(pos)
    groups = defaultdict(list)
    for i, d in enumerate(docs):
        if d["source"] >= 0:
            groups[d["source"]].append(i)
    for s, dups in groups.items():
        first = min(dups, key=pos.__getitem__)
        if pos[first] < pos[s]:
            pos[first], pos[s] = pos[s], pos[first]
    out = [None] * len(docs)
    keys = ("text", "lang", "kind", "variant", "source") + (("original",) if originals else ())
    for i, d in enumerate(docs):
        out[pos[i]] = {k: d[k] for k in keys if k in d} | {"source": pos[d["source"]] if d["source"] >= 0 else -1}
    return out


def write_jsonl(docs: list[dict], path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


# ---- self-check ----------------------------------------------------------------------------------------


def _shingles(text: str) -> set[str]:
    t = " ".join(text.lower().split())
    return {t[i : i + 5] for i in range(len(t) - 4)}


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def _summary(xs: list[float], at: float | None = None) -> dict:
    if not xs:
        return {"n": 0}
    out = {"n": len(xs), "mean": round(sum(xs) / len(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}
    return out | ({f"share>={at}": round(sum(x >= at for x in xs) / len(xs), 3)} if at is not None else {})


def _structure(docs: list[dict]) -> list[str]:
    """Sources as labelled; no clean page repeating a paragraph; garbled text made of what its label says."""
    problems = []
    for i, d in enumerate(docs):
        s, kind, paras = d["source"], d["kind"], d["text"].split("\n\n")
        if kind == "clean" and len(set(paras)) < len(paras):
            problems.append(f"{i}: clean document with a repeated paragraph")
        if d["variant"] in SHARE_AT_LEAST and label_share(d["variant"], d["text"]) < SHARE_AT_LEAST[d["variant"]]:
            problems.append(f"{i}: {d['variant']} document below its share of {SHARE_AT_LEAST[d['variant']]}")
        if kind in ("near_dup", "exact_dup"):
            src = docs[s] if 0 <= s < i else None
            if src is None or src["kind"] != "clean" or src["lang"] != d["lang"]:
                problems.append(f"{i}: source {s} is not an earlier clean {d['lang']} document")
            elif (d["text"] == src["text"]) != (kind == "exact_dup"):
                problems.append(f"{i}: {kind} whose text {'differs from' if kind == 'exact_dup' else 'is'} its source")
        elif s != -1:
            problems.append(f"{i}: {kind} with source {s}")
    return problems


def check(docs: list[dict], pairs: int = 300, seed: int = 0) -> dict:
    """Verify the labels and measure the corpus: sources, clean-pair and near-duplicate 5-gram Jaccard, ftfy on
    the mojibake (exactly, against "original" where build(originals=True) kept it), garble scores, sizes."""
    rng, problems, stats = random.Random(seed), _structure(docs), {"n": len(docs)}
    ftfy, cache = _ftfy(), {}
    sh = lambda i: cache[i] if i in cache else cache.setdefault(i, _shingles(docs[i]["text"]))  # noqa: E731
    by = defaultdict(list)
    for i, d in enumerate(docs):
        by[d["lang"], d["kind"], d["variant"]].append(i)
    for lang in ("en", "zh"):
        ids = by[lang, "clean", ""]
        sample = [rng.sample(ids, 2) for _ in range(pairs)] if len(ids) > 1 else []
        stats[f"clean_pairs_jaccard_{lang}"] = _summary([_jaccard(sh(a), sh(b)) for a, b in sample])
        texts = [docs[i]["text"] for i in ids]
        size = [len(t.split()) if lang == "en" else len(t) for t in texts]
        stats[f"clean_{lang}_{'words' if lang == 'en' else 'chars'}"] = _summary(size)
        stats[f"clean_{lang}_paragraphs"] = _summary([t.count("\n\n") + 1 for t in texts])
        for v in NEAR:
            js = [_jaccard(sh(i), sh(docs[i]["source"])) for i in by[lang, "near_dup", v]]
            stats[f"near_dup_jaccard_{lang}_{v}"] = _summary(js, at=0.7)
        fixable = [docs[i] for i in by[lang, "mojibake_fixable", ""]]
        exact = [
            ftfy.fix_encoding(d["text"]) == d["original"] and ftfy.fix_text(d["text"]) == ftfy.fix_text(d["original"])
            if "original" in d
            else ftfy.fix_encoding(d["text"]) != d["text"] and garble_score(ftfy.fix_encoding(d["text"]), lang) < 0.02
            for d in fixable
        ]
        stats[f"mojibake_fixable_{lang}"] = {"n": len(exact), "repaired_exactly": sum(exact)}
        unfixable = [docs[i] for i in by[lang, "garbled", "mojibake_unfixable"]]
        fixed = [ftfy.fix_text(d["text"]) for d in unfixable]
        restored = sum(d.get("original") in (f, ftfy.fix_encoding(d["text"])) for d, f in zip(unfixable, fixed))
        garbled = sum(garble_score(f, lang) >= 0.3 for f in fixed)
        stats[f"mojibake_unfixable_{lang}"] = {"n": len(fixed), "restored": restored, "garbled_after_ftfy": garbled}
        if sum(exact) < len(exact):
            problems.append(
                f"{lang}: {len(exact) - sum(exact)} mojibake_fixable documents ftfy does not repair exactly"
            )
        if restored or garbled < len(fixed):
            problems.append(f"{lang}: mojibake_unfixable that ftfy repairs: {stats[f'mojibake_unfixable_{lang}']}")
        for v in SHARE_AT_LEAST:
            stats[f"share_{lang}_{v}"] = _summary([label_share(v, docs[i]["text"]) for i in by[lang, "garbled", v]])
        for kind, v in [("clean", ""), ("mojibake_fixable", ""), *(("garbled", g) for g in GARBLED)]:
            scores = [garble_score(docs[i]["text"], lang) for i in by[lang, kind, v]]
            stats[f"garble_score_{lang}_{kind}{'_' + v if v else ''}"] = _summary(scores)
    stats["problems"], stats["ok"] = problems[:20], not problems
    return stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the corpus here as jsonl")
    ap.add_argument("--check", action="store_true", help="run check() and print its stats as JSON")
    ap.add_argument("--originals", action="store_true", help='write mojibake documents\' "original" too')
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    docs = build(args.n, args.seed, originals=True)
    took = time.perf_counter() - t0
    if args.out:
        write_jsonl(
            docs if args.originals else [{k: v for k, v in d.items() if k != "original"} for d in docs], args.out
        )
    for (lang, kind, variant), c in sorted(Counter((d["lang"], d["kind"], d["variant"]) for d in docs).items()):
        print(f"{lang}  {kind:17} {variant:19} {c:7}")
    print(f"{len(docs)} documents in {took:.1f} s" + (f", written to {args.out}" if args.out else ""))
    if args.check:
        for key, value in check(docs).items():
            print(f"{key}: {json.dumps(value, ensure_ascii=False)}")


if __name__ == "__main__":
    main()
