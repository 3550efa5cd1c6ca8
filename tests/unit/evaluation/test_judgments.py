"""People's blind judgments of a side-by-side page read back (zero_recipes/evaluation/judgments.py): exports
written as the page writes them (left/right from blind_order), checked against the page's records, summarised,
and turned into DPO pairs."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
import scipy.stats

from zero_recipes.errors import ConfigError
from zero_recipes.evaluation.judgments import preference_pairs, read_judgments, summarise, summary_text
from zero_recipes.evaluation.sample_records import Answer, blind_order, page_id, records_of, rows_of

A, B = "outputs/tiny-sft", "outputs/tiny-llama"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
PROMPTS = [
    {"prompt": "What is 2 + 2?", "reference": "4"},
    {"prompt": "Name a primary colour."},
    {"prompt": CHAT},
    {"prompt": "Spell cat backwards."},
    {"prompt": "Is 7 prime?"},
    {"prompt": "Translate 'hello' to French."},
    {"prompt": "What comes after Monday?"},
    {"prompt": "How many legs has a spider?"},
]
# Row 5: the sft model's answer stopped at max_new_tokens; row 7: the base model's. Row 8: older records that
# did not keep `ended` (plain strings, ended None).
OUT_A = [Answer(t, True) for t in ["4", "Red.", "Paris.", "tac"]]
OUT_A += [Answer("Yes, 7 is prime because it", False), Answer("Bonjour.", True), Answer("Tuesday.", True), "Eight."]
OUT_B = [Answer(t, True) for t in ["2 + 2 = 5", "Blue", "Lyon", "cat", "Yes.", "Hola"]]
OUT_B += [Answer("Monday is followed by Tuesday, then", False), "Six."]


def page(prompts=PROMPTS, out_a=OUT_A, out_b=OUT_B, a=A, b=B):
    return records_of(prompts, a, out_a, "greedy") + records_of(prompts, b, out_b, "greedy")


RECORDS = page()


def judgment(records, row, winner, judge="alice", revealed=False):
    """A line as the page writes it: `winner` is a model label (put on whichever side blind_order showed it),
    "tie" or "both_bad"."""
    pid = page_id(records)
    rows, columns = rows_of(records)
    left, right = blind_order(pid, row, list(columns))
    choice = winner if winner in ("tie", "both_bad") else "left" if winner == left else "right"
    return {
        "page": pid,
        "judge": judge,
        "row": row,
        "prompt": rows[row - 1]["prompt"],
        "left": left,
        "right": right,
        "choice": choice,
        "revealed": revealed,
        "at": "2025-06-01T12:00:00Z",
    }


def write(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines), "utf-8")
    return path


def export(tmp_path, judge, choices, records=RECORDS, revealed=()):
    return write(
        tmp_path / f"{judge}.jsonl", [judgment(records, r, w, judge, r in revealed) for r, w in choices.items()]
    )


# alice judges every row, bob the first four; rows 5 and 6 are alice's revealed ones
ALICE = {1: A, 2: A, 3: B, 4: "tie", 5: A, 6: "both_bad", 7: B, 8: A}
BOB = {1: A, 2: B, 3: B, 4: A}
# Per row, the sft model's score is the mean over that row's judgments of 1 / 0.5 / 0
SCORES_A = [1.0, 0.5, 0.0, 0.75, 1.0, 0.5, 0.0, 1.0]


@pytest.fixture
def two_judges(tmp_path):
    paths = [export(tmp_path, "alice", ALICE, revealed={5, 6}), export(tmp_path, "bob", BOB)]
    return read_judgments(paths, RECORDS)


def test_the_page_shows_both_orders():
    # Otherwise every un-blinding test below could pass with the columns never swapped
    orders = {blind_order(page_id(RECORDS), r, [A, B]) for r in range(1, 9)}
    assert orders == {(A, B), (B, A)}


def test_win_rate_weighs_each_prompt_the_same_with_a_bootstrap_interval(two_judges):
    s = summarise(two_judges, n_resamples=2000, seed=3)
    assert s["models"] == [A, B] and s["judges"] == ["alice", "bob"]
    assert s["judgments"] == 12 and s["prompts_judged"] == 8
    a, b = s["win_rates"][A], s["win_rates"][B]
    # 4.75 / 8 per prompt; a per-judgment mean would be 7 / 12
    assert a["rate"] == pytest.approx(0.59375) and b["rate"] == pytest.approx(0.40625)
    ci = scipy.stats.bootstrap(
        (np.array(SCORES_A),),
        np.mean,
        n_resamples=2000,
        confidence_level=0.95,
        method="percentile",
        rng=np.random.default_rng(3),
    ).confidence_interval
    assert (a["low"], a["high"]) == pytest.approx((ci.low, ci.high))
    assert (b["low"], b["high"]) == pytest.approx((1 - ci.high, 1 - ci.low))
    assert a["low"] < a["rate"] < a["high"] and b["low"] < b["rate"] < b["high"]
    assert (a["wins"], a["losses"], a["ties"], a["both_bad"]) == (6, 4, 1, 1)
    assert (b["wins"], b["losses"], b["ties"], b["both_bad"]) == (4, 6, 1, 1)
    assert s["revealed"] == 2
    assert s["cut"] == {A: 1, B: 1}
    assert json.loads(json.dumps(s)) == s


def test_a_left_choice_credits_whichever_model_was_on_the_left(tmp_path):
    pid = page_id(RECORDS)
    a_right = next(r for r in range(1, 9) if blind_order(pid, r, [A, B]) == (B, A))
    line = judgment(RECORDS, a_right, "tie") | {"choice": "left"}
    s = summarise(read_judgments([write(tmp_path / "j.jsonl", [line])], RECORDS))
    assert s["win_rates"][B]["wins"] == 1 and s["win_rates"][B]["rate"] == 1.0
    assert s["win_rates"][A]["losses"] == 1 and s["win_rates"][A]["rate"] == 0.0
    assert s["win_rates"][A]["low"] is None and s["win_rates"][A]["high"] is None
    assert s["position"] == {"decisive": 1, "left_won": 1, "rate": 1.0, "p_value": 1.0}


def test_agreement_is_percent_and_cohens_kappa(two_judges):
    (pair,) = summarise(two_judges, n_resamples=100)["agreement"]
    # Shared rows 1-4: alice A, A, B, tie; bob A, B, B, A. Agree on 2 of 4; chance agreement from the marginals
    # (alice A .5 B .25 tie .25, bob A .5 B .5) is .5*.5 + .25*.5 = .375, so kappa = (.5 - .375) / .625
    assert pair == {"judges": ["alice", "bob"], "shared": 4, "percent": 50.0, "kappa": pytest.approx(0.2)}


def test_kappa_is_none_without_a_warning_when_undefined_and_judges_without_shared_rows_are_not_paired(tmp_path):
    paths = [
        export(tmp_path, "alice", {1: A, 2: A}),
        export(tmp_path, "bob", {1: A, 2: A}),
        export(tmp_path, "carol", {7: B}),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agreement = summarise(read_judgments(paths, RECORDS), n_resamples=100)["agreement"]
    assert agreement == [{"judges": ["alice", "bob"], "shared": 2, "percent": 100.0, "kappa": None}]


def test_position_bias_counts_decisive_left_choices(tmp_path):
    sides = ["left", "left", "right", "left", "left", "left", "tie", "both_bad"]
    lines = [judgment(RECORDS, r, "tie") | {"choice": c} for r, c in enumerate(sides, 1)]
    s = summarise(read_judgments([write(tmp_path / "j.jsonl", lines)], RECORDS), n_resamples=100)
    # Two-sided binomial p for 5 of 6: 2 * (6 + 1) / 64
    assert s["position"] == {"decisive": 6, "left_won": 5, "rate": pytest.approx(5 / 6), "p_value": 14 / 64}


def test_equal_scores_give_a_zero_width_interval_without_a_warning(tmp_path):
    path = export(tmp_path, "alice", {r: A for r in range(1, 9)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = summarise(read_judgments([path], RECORDS), n_resamples=500)
    a, b = s["win_rates"][A], s["win_rates"][B]
    assert (a["rate"], a["low"], a["high"], a["wins"]) == (1.0, 1.0, 1.0, 8)
    assert (b["rate"], b["low"], b["high"], b["losses"]) == (0.0, 0.0, 0.0, 8)


def test_summary_text(two_judges):
    text = summary_text(summarise(two_judges, n_resamples=500))
    assert re.search(rf"{A} +59.4 % \(95 % CI \d", text) and re.search(rf"{B} +40.6 % \(95 % CI \d", text)
    assert "6 wins, 4 losses, 1 ties, 1 both bad" in text
    assert "8 prompts judged by 2 judge(s) (alice, bob)" in text
    assert "percent agreement 50.0 %, Cohen's kappa 0.20" in text
    decisive = [(r, w) for r, w in [*ALICE.items(), *BOB.items()] if w in (A, B)]
    left = sum(blind_order(page_id(RECORDS), r, [A, B])[0] == w for r, w in decisive)
    p = scipy.stats.binomtest(left, 10).pvalue
    assert f"left column won {left} of 10 decisive judgments ({100 * left / 10:.1f} %, p = {p:.3g})" in text


def test_preference_pairs_from_the_majority_leave_out_ties_splits_and_cut_winners(two_judges):
    pairs, counts = preference_pairs(two_judges)
    # Row 1: A twice; 2: A vs B (split); 3: B twice (the chat prompt); 4: tie vs A (split); 5: A, whose answer
    # was cut; 6: both bad; 7: B, cut; 8: A (ended unknown: taken as ended)
    assert counts == {"pairs": 3, "tie": 0, "both_bad": 1, "split": 2, "chosen_cut": 2, "empty_answer": 0}
    assert pairs == [
        {
            "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "2 + 2 = 5"}],
        },
        {
            "prompt": CHAT,
            "chosen": [{"role": "assistant", "content": "Lyon"}],
            "rejected": [{"role": "assistant", "content": "Paris."}],
        },
        {
            "prompt": [{"role": "user", "content": "How many legs has a spider?"}],
            "chosen": [{"role": "assistant", "content": "Eight."}],
            "rejected": [{"role": "assistant", "content": "Six."}],
        },
    ]
    kept, counts = preference_pairs(two_judges, keep_truncated=True)
    assert counts == {"pairs": 5, "tie": 0, "both_bad": 1, "split": 2, "chosen_cut": 0, "empty_answer": 0}
    assert [p["chosen"][0]["content"] for p in kept] == [
        "4",
        "Lyon",
        "Yes, 7 is prime because it",
        "Monday is followed by Tuesday, then",
        "Eight.",
    ]


def test_preference_pairs_with_three_judges(tmp_path):
    paths = [
        export(tmp_path, "alice", {1: A, 2: "tie", 3: B, 4: A}),
        export(tmp_path, "bob", {1: A, 2: "tie", 3: A}),
        export(tmp_path, "carol", {1: B, 3: "tie"}),
    ]
    pairs, counts = preference_pairs(read_judgments(paths, RECORDS))
    # Row 1: A two to one; 2: tie; 3: one each (split); 4: A. Row 4's loser was not cut, which is no reason to drop it
    assert counts == {"pairs": 2, "tie": 1, "both_bad": 0, "split": 1, "chosen_cut": 0, "empty_answer": 0}
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("4", "2 + 2 = 5"),
        ("tac", "cat"),
    ]


def test_the_later_line_for_a_row_wins_within_a_file(tmp_path):
    path = write(tmp_path / "alice.jsonl", [judgment(RECORDS, 2, A), judgment(RECORDS, 1, B), judgment(RECORDS, 2, B)])
    judged = read_judgments([path], RECORDS)
    s = summarise(judged, n_resamples=100)
    assert s["judgments"] == 2 and s["win_rates"][B]["wins"] == 2 and s["win_rates"][A]["wins"] == 0


def other_page_export(tmp_path, records):
    return write(tmp_path / "other.jsonl", [judgment(records, 1, "tie")])


def bad(tmp_path, case):
    """(paths, words the message must hold) for one bad input; only that case's files are written."""
    j = judgment(RECORDS, 1, A)
    f = tmp_path / "bad.jsonl"
    cases = {
        "missing file": lambda: ([tmp_path / "nope.jsonl"], "no such file"),
        "empty file": lambda: ([write(f, ["", "  "])], "holds no judgments"),
        "not json": lambda: ([write(f, [j, "{oops"])], "bad.jsonl:2: not JSON"),
        "not an object": lambda: ([write(f, ["[1, 2]"])], "bad.jsonl:1: a JSON list"),
        "missing key": lambda: (
            [write(f, [{k: v for k, v in j.items() if k != "choice"}])],
            "not a judgment (no choice)",
        ),
        "choice": lambda: ([write(f, [j | {"choice": "sft"}])], "choice 'sft' is not one of"),
        "row not int": lambda: ([write(f, [j | {"row": "1"}])], "row '1' is not a row number"),
        "row a bool": lambda: ([write(f, [j | {"row": True}])], "row True is not a row number"),
        "other models": lambda: (
            [other_page_export(tmp_path, page(a="outputs/x", b=B))],
            "'outputs/x' are not the page's",
        ),
        "other prompts": lambda: (
            [other_page_export(tmp_path, page(prompts=[{"prompt": f"Q{i}"} for i in range(8)]))],
            "its prompts are not the page's",
        ),
        "regenerated": lambda: ([other_page_export(tmp_path, page(out_a=["x"] * 8))], "page was regenerated"),
        "row outside": lambda: (
            [write(f, [j | {"row": 9}])],
            "bad.jsonl:1: row 9 with a prompt this page does not have",
        ),
        "prompt edited": lambda: ([write(f, [j | {"prompt": "What is 3 + 3?"}])], "a prompt this page does not have"),
        "sides edited": lambda: ([write(f, [j | {"left": "outputs/x"}])], "not this page's two models"),
        "two judges": lambda: (
            [write(f, [j, judgment(RECORDS, 2, A, "bob")])],
            "bad.jsonl:2: a second judge 'bob' after 'alice'",
        ),
        "revealed": lambda: ([write(f, [j | {"revealed": "yes"}])], "revealed 'yes' is not true or false"),
        "no judge": lambda: ([write(f, [j | {"judge": "  "}])], "no judge name"),
        "same judge twice": lambda: (
            [export(tmp_path, "alice", {1: A}), write(f, [judgment(RECORDS, 2, A, " ALICE ")])],
            "alice.jsonl and",
        ),
    }
    return cases[case]()


BAD = [
    "missing file",
    "empty file",
    "not json",
    "not an object",
    "missing key",
    "choice",
    "row not int",
    "row a bool",
    "other models",
    "other prompts",
    "regenerated",
    "row outside",
    "prompt edited",
    "sides edited",
    "two judges",
    "revealed",
    "no judge",
    "same judge twice",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_naming_the_file(tmp_path, case):
    paths, words = bad(tmp_path, case)
    with pytest.raises(ConfigError) as e:
        read_judgments(paths, RECORDS)
    message = str(e.value)
    assert "\n" not in message and str(paths[-1]) in message and words in message
    if case in ("other models", "other prompts", "regenerated"):
        assert "judge this page, or point --samples_output at the page" in message
    if case == "same judge twice":
        assert str(paths[0]) in message and "'ALICE'" in message and "give one export per judge" in message


def test_a_page_without_two_columns_says_to_compare(tmp_path):
    path = export(tmp_path, "alice", {1: A})
    with pytest.raises(ConfigError, match="judging compares two: write it with --compare") as e:
        read_judgments([path], records_of(PROMPTS, A, OUT_A, "greedy"))
    assert "\n" not in str(e.value)


def test_a_blank_answer_is_not_written_as_either_side_of_a_pair(tmp_path):
    # a model that answered only whitespace: the judge preferred the other, but train.py would drop the pair
    # (empty rejected), so it is counted here instead of written
    records = page(out_a=[Answer("\n\n", True), *OUT_A[1:]])
    judged = read_judgments([export(tmp_path, "alice", {1: B, 2: A}, records)], records)
    pairs, counts = preference_pairs(judged)
    assert counts["empty_answer"] == 1 and counts["pairs"] == 1
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": "Red."}]
