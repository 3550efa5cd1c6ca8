"""People's blind judgments of a side-by-side page, read back against the page's records: checked (each export
must come from this page, one judge a file), summarised (win rates with bootstrap intervals, agreement between
judges, position bias) and turned into DPO preference pairs in TRL's conversational format.

A judgment is one line of the page's export: {"page", "judge", "row", "prompt", "left", "right", "choice",
"revealed", "at"}. `left`/`right` are the column labels as that row showed them, so a "left" choice is
un-blinded by reading `left`, never by assuming an order.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .sample_records import json_object, page_id, rows_of

CHOICES = ("left", "right", "tie", "both_bad")
# `at` is informational; everything else is read
KEYS = ("page", "judge", "row", "prompt", "left", "right", "choice", "revealed")
REDO = "give the JSONL file the judging page exported"


@dataclass
class Judged:
    page: str
    models: tuple[str, str]  # the page's two column labels, in column order
    rows: list[dict]  # rows_of(records)[0]: row n is rows[n - 1]
    judgments: dict[str, dict[int, dict]]  # judge (as typed, stripped) -> row -> that judge's latest judgment


def outcome(j: dict) -> str:
    """The un-blinded outcome: which model won, whatever side it was shown on."""
    return f"{j[j['choice']]} better" if j["choice"] in ("left", "right") else j["choice"]


def read_judgments(paths: list[Path], records: list[dict]) -> Judged:
    rows, columns = rows_of(records)
    if len(columns) != 2:
        raise ConfigError(
            f"the samples page has {len(columns)} column(s) ({', '.join(map(repr, columns)) or 'none'}); "
            "judging compares two: write it with --compare"
        )
    if not paths:
        raise ConfigError("no judgment files given; give the JSONL file(s) the judging page exported")
    judged = Judged(page_id(records), tuple(columns), rows, {})
    files: dict[str, Path] = {}  # casefolded judge -> the file holding their judgments
    for path in map(Path, paths):
        judge, by_row = _read_file(path, judged)
        key = judge.casefold()
        if key in files:
            raise ConfigError(
                f"{files[key]} and {path} are both exports of judge {judge!r}; give one export per judge "
                "(a later export holds all of that judge's choices)"
            )
        files[key] = path
        judged.judgments[judge] = by_row
    return judged


def _read_file(path: Path, judged: Judged) -> tuple[str, dict[int, dict]]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; {REDO}")
    judge, by_row = None, {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        j = _judgment(json_object(line, where), where, path, judged)
        name = j["judge"].strip()
        if judge is not None and name.casefold() != judge.casefold():
            raise ConfigError(
                f"{where}: a second judge {name!r} after {judge!r}; give each judge's export as its own file"
            )
        judge = judge or name
        # A hand-merged file may judge a row twice: the later line is the later choice, as the page would export
        by_row.pop(j["row"], None)
        by_row[j["row"]] = j
    if judge is None:
        raise ConfigError(f"{path} holds no judgments; {REDO}")
    return judge, dict(sorted(by_row.items()))


def _judgment(j: dict, where: str, path: Path, judged: Judged) -> dict:
    missing = [k for k in KEYS if k not in j]
    if missing:
        raise ConfigError(f"{where}: not a judgment (no {', '.join(missing)}); {REDO}")
    if j["choice"] not in CHOICES:
        raise ConfigError(f"{where}: choice {j['choice']!r} is not one of {', '.join(CHOICES)}; {REDO}")
    if not isinstance(j["row"], int) or isinstance(j["row"], bool):
        raise ConfigError(f"{where}: row {j['row']!r} is not a row number; {REDO}")
    if not isinstance(j["judge"], str) or not j["judge"].strip():
        raise ConfigError(f"{where}: no judge name; type a name on the judging page and export again")
    shown_models = {j["left"], j["right"]} == set(judged.models) and j["left"] != j["right"]
    rows = judged.rows
    shown_prompt = 1 <= j["row"] <= len(rows) and j["prompt"] == rows[j["row"] - 1]["prompt"]
    if j["page"] != judged.page:
        # Say which part of the page differs, so the judge can tell a wrong file from a regenerated page
        why = (
            f"its models {j['left']!r}/{j['right']!r} are not the page's {judged.models[0]!r}/{judged.models[1]!r}"
            if not shown_models
            else "its prompts are not the page's"
            if not shown_prompt
            else "the answers differ: the page was regenerated since"
        )
        raise ConfigError(
            f"{where}: made on another page ({why}); judge this page, or point --samples_output at the page "
            f"{path} came from"
        )
    # The page id matches, yet the line does not fit it: edited or merged by hand
    if not shown_prompt:
        raise ConfigError(
            f"{where}: row {j['row']} with a prompt this page does not have at that row (the page has "
            f"{len(rows)} rows); the file was edited by hand: {REDO}"
        )
    if not shown_models:
        raise ConfigError(
            f"{where}: left/right {j['left']!r}/{j['right']!r} are not this page's two models; the file was "
            f"edited by hand: {REDO}"
        )
    if not isinstance(j["revealed"], bool):
        raise ConfigError(f"{where}: revealed {j['revealed']!r} is not true or false; {REDO}")
    return j


def summarise(judged: Judged, n_resamples: int = 10_000, seed: int = 0) -> dict:
    a, b = judged.models
    every = [j for by_row in judged.judgments.values() for j in by_row.values()]
    per_row: dict[int, list[float]] = {}
    for j in every:
        # Both-bad counts as a tie (half a win each), as Chatbot Arena's "both bad" vote does
        per_row.setdefault(j["row"], []).append({f"{a} better": 1.0, f"{b} better": 0.0}.get(outcome(j), 0.5))
    scores = np.array([np.mean(s) for _, s in sorted(per_row.items())])
    rate, low, high = _rate_interval(scores, n_resamples, seed)
    counts = Counter(outcome(j) for j in every)
    ties, both_bad = counts["tie"], counts["both_bad"]

    def flip(x):
        return None if x is None else 1.0 - x

    decisive = [j for j in every if j["choice"] in ("left", "right")]
    left_won = sum(j["choice"] == "left" for j in decisive)
    return {
        "page": judged.page,
        "models": [a, b],
        "judges": list(judged.judgments),
        "judgments": len(every),
        "prompts_judged": len(per_row),
        "win_rates": {
            a: _win_rate(rate, low, high, counts[f"{a} better"], counts[f"{b} better"], ties, both_bad),
            b: _win_rate(
                flip(rate), flip(high), flip(low), counts[f"{b} better"], counts[f"{a} better"], ties, both_bad
            ),
        },
        "agreement": _agreement(judged),
        "position": {
            "decisive": len(decisive),
            "left_won": left_won,
            "rate": left_won / len(decisive) if decisive else None,
            "p_value": _binom_p(left_won, len(decisive)),
        },
        "revealed": sum(bool(j["revealed"]) for j in every),
        "cut": {m: sum(judged.rows[r - 1]["ended"].get(m) is False for r in per_row) for m in (a, b)},
    }


def _win_rate(rate, low, high, wins, losses, ties, both_bad) -> dict:
    return {"rate": rate, "low": low, "high": high, "wins": wins, "losses": losses, "ties": ties, "both_bad": both_bad}


def _rate_interval(scores: np.ndarray, n_resamples: int, seed: int) -> tuple:
    """The first model's rate and 95 % percentile-bootstrap interval over per-row scores (rows resampled, so
    each prompt weighs the same whatever the number of judges)."""
    if len(scores) == 0:
        return None, None, None
    rate = float(scores.mean())
    if len(scores) < 2:
        return rate, None, None
    from scipy.stats import DegenerateDataWarning, bootstrap

    with warnings.catch_warnings():
        # All scores equal gives a zero-width interval, which is the right answer; scipy may call such data
        # degenerate (1.17's percentile method only does when the interval is nan), which tells the user nothing
        warnings.simplefilter("ignore", DegenerateDataWarning)
        ci = bootstrap(
            (scores,),
            np.mean,
            n_resamples=n_resamples,
            confidence_level=0.95,
            method="percentile",
            rng=np.random.default_rng(seed),
        ).confidence_interval
    return rate, float(ci.low), float(ci.high)


def _agreement(judged: Judged) -> list[dict]:
    from sklearn.metrics import cohen_kappa_score

    pairs = []
    for (j1, rows1), (j2, rows2) in combinations(judged.judgments.items(), 2):
        shared = sorted(set(rows1) & set(rows2))
        if not shared:
            continue
        o1, o2 = [outcome(rows1[r]) for r in shared], [outcome(rows2[r]) for r in shared]
        with warnings.catch_warnings():
            # One label throughout leaves kappa undefined (nan, reported as None); sklearn's warning adds nothing
            warnings.simplefilter("ignore")
            kappa = float(cohen_kappa_score(o1, o2))
        percent = 100.0 * sum(x == y for x, y in zip(o1, o2)) / len(shared)
        pairs.append(
            {"judges": [j1, j2], "shared": len(shared), "percent": percent, "kappa": None if np.isnan(kappa) else kappa}
        )
    return pairs


def _binom_p(k: int, n: int) -> float | None:
    if n == 0:
        return None
    from scipy.stats import binomtest

    return float(binomtest(k, n, 0.5).pvalue)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def summary_text(summary: dict) -> str:
    lines = ["win rate (per prompt; a tie or both-bad counts half to each):"]
    width = max(map(len, summary["models"]))
    for m in summary["models"]:
        w = summary["win_rates"][m]
        ci = "" if w["low"] is None else f" (95 % CI {_pct(w['low'])} to {_pct(w['high'])})"
        lines.append(
            f"  {m:<{width}}  {_pct(w['rate'])}{ci}: {w['wins']} wins, {w['losses']} losses, {w['ties']} ties, "
            f"{w['both_bad']} both bad"
        )
    judges = summary["judges"]
    lines.append(
        f"{summary['prompts_judged']} prompts judged by {len(judges)} judge(s) ({', '.join(judges)}); "
        f"{summary['judgments']} judgments, {summary['revealed']} made with model names revealed"
    )
    cut = ", ".join(f"{m} {n}" for m, n in summary["cut"].items() if n)
    if cut:
        lines.append(f"answers cut off at max_new_tokens among judged prompts: {cut}")
    for p in summary["agreement"]:
        kappa = "undefined" if p["kappa"] is None else f"{p['kappa']:.2f}"
        lines.append(
            f"agreement {p['judges'][0]} vs {p['judges'][1]} on {p['shared']} shared prompts: "
            f"percent agreement {p['percent']:.1f} %, Cohen's kappa {kappa}"
        )
    pos = summary["position"]
    if pos["decisive"]:
        lines.append(
            f"position bias: left column won {pos['left_won']} of {pos['decisive']} decisive judgments "
            f"({_pct(pos['rate'])}, p = {pos['p_value']:.3g})"
        )
    else:
        lines.append("position bias: no decisive judgments")
    return "\n".join(lines)


def preference_pairs(judged: Judged, keep_truncated: bool = False) -> tuple[list[dict], dict[str, int]]:
    """One DPO pair per judged row with a decisive majority; the rest counted by why they were left out."""
    a, b = judged.models
    by_row: dict[int, list[str]] = {}
    for rows in judged.judgments.values():
        for r, j in rows.items():
            by_row.setdefault(r, []).append(outcome(j))
    pairs, counts = [], {"pairs": 0, "tie": 0, "both_bad": 0, "split": 0, "chosen_cut": 0, "empty_answer": 0}
    for r, outcomes in sorted(by_row.items()):
        top = Counter(outcomes).most_common(2)
        verdict = "split" if len(top) == 2 and top[0][1] == top[1][1] else top[0][0]
        if verdict in ("split", "tie", "both_bad"):
            counts[verdict] += 1
            continue
        row = judged.rows[r - 1]
        winner = a if verdict == f"{a} better" else b
        loser = b if winner == a else a
        # An answer stopped at max_new_tokens would teach the policy to prefer a cut-off answer; None is an
        # older record's unknown, taken as ended
        if row["ended"].get(winner) is False and not keep_truncated:
            counts["chosen_cut"] += 1
            continue
        # a blank answer is no text to prefer or avoid: train.py would drop the pair, so it is not written
        if not row["outputs"][winner].strip() or not row["outputs"][loser].strip():
            counts["empty_answer"] += 1
            continue
        prompt = row["prompt"]
        pairs.append(
            {
                "prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                "chosen": [{"role": "assistant", "content": row["outputs"][winner]}],
                "rejected": [{"role": "assistant", "content": row["outputs"][loser]}],
            }
        )
    counts["pairs"] = len(pairs)
    return pairs, counts
