"""Human judgment that trains the model, as people use it: an SFT model and its base answer the same prompts
(tools/evaluate.py --compare), two judges judge the page blind in a real headless Chromium driven by selenium
(keys, a reload mid-way, the names revealed, the export downloaded), --judgments turns their files into win
rates and DPO pairs, train.py --objective dpo trains on those pairs, and the trained model is compared again.
The reading and statistics are unit-tested in tests/unit/evaluation/test_judgments.py. CI installs chromium and
chromium-driver (.ci/run): without them these fail, naming what to install."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import CONFIGS, FAST, REPO, launch, tool_in_process
from zero_recipes.evaluation.sample_records import blind_order, page_id, read_records, rows_of

PROMPTS = 12  # held-out tiny-instructions questions, with references
# Sampled: these 8-step models answer greedily with blank lines, which no one would write as a pair
DECODING = ("--max_new_tokens", "12", "--temperature", "1.0")
CHOICE = {"1": "left", "2": "right", "3": "tie", "4": "both_bad"}
# What each judge presses, row by row from row 1 ("j" skips a row, "k" goes back one). Ann goes back to change
# row 3, reloads after row 5, skips row 7 and reveals the names before her last four choices.
ANN = ["1", "2", "3", "k", "4", "1", "2", "RELOAD", "1", "j", "2", "REVEAL", "1", "1", "2", "3"]
# Bob reads each row and prefers the shorter answer (a tie when equal): a consistent preference, which DPO on his
# pairs can learn. (These 8-step models give nearly the same answer to every prompt, so Ann's fixed keys
# contradict themselves across rows.)
BOB = "shorter"


def browser(downloads: Path):
    """Debian's chromium through its chromedriver, headless, a fresh profile, downloads to `downloads`. The flags
    keep Chromium off the network, which this machine does not have."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [b for b in ("chromium", "chromedriver") if not shutil.which(b)]
    if missing:
        pytest.fail(f"no {' or '.join(missing)} on PATH: apt-get install chromium chromium-driver (.ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"):
        options.add_argument(flag)
    options.add_argument("--disable-background-networking")
    options.add_argument("--disable-component-update")
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def judge_in_browser(page: Path, name: str, keys, downloads: Path) -> tuple[Path, dict, list[str]]:
    """A person at the page: types a name, presses `keys` (or, for "shorter", the key for each row's shorter
    answer as read off the page), exports. Returns the downloaded file, what the page showed after the reload
    (if any), and the keys pressed."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    downloads.mkdir(parents=True, exist_ok=True)
    driver = browser(downloads)
    seen = {}
    try:
        driver.get(page.resolve().as_uri())
        driver.find_element(By.ID, "judge").send_keys(name)
        driver.find_element(By.TAG_NAME, "h1").click()  # out of the name box: keys now judge
        if keys == "shorter":
            keys = [shorter_key(row) for row in driver.find_elements(By.CSS_SELECTOR, "tr[data-row]")]
        for key in keys:
            if key == "RELOAD":
                time.sleep(1)  # a person's reload comes a moment after their last key, not within microseconds
                driver.refresh()
                seen = {
                    "progress": driver.find_element(By.ID, "progress").text,
                    "name": driver.find_element(By.ID, "judge").get_attribute("value"),
                    "chosen": [
                        b.get_attribute("data-choice") for b in driver.find_elements(By.CSS_SELECTOR, ".chosen")
                    ],
                    "current": driver.find_element(By.CSS_SELECTOR, "tr.current").get_attribute("data-row"),
                }
            elif key == "REVEAL":
                driver.find_element(By.ID, "reveal").click()
                seen["names_shown"] = driver.find_element(By.CSS_SELECTOR, ".names").is_displayed()
            else:
                ActionChains(driver).send_keys(key).perform()
        driver.find_element(By.ID, "export").click()
        deadline = time.time() + 30
        while time.time() < deadline:
            done = [f for f in downloads.iterdir() if f.suffix == ".jsonl"]
            if done:
                return done[0], seen, keys
            time.sleep(0.1)
        raise AssertionError(f"no export downloaded; the page said: {driver.find_element(By.ID, 'status').text}")
    finally:
        driver.quit()


def shorter_key(row) -> str:
    from selenium.webdriver.common.by import By

    a, b = (len(cell.text) for cell in row.find_elements(By.CSS_SELECTOR, "td.out .text"))
    return "3" if a == b else "1" if a < b else "2"


def expected_choices(keys: list[str]) -> dict[int, tuple[str, bool]]:
    """row -> (choice, revealed) that the keys make, as the page's shortcuts say."""
    row, made, revealed = 1, {}, False
    for key in keys:
        if key == "REVEAL":
            revealed = True
        elif key == "j":
            row += 1
        elif key == "k":
            row -= 1
        elif key in CHOICE:
            made[row] = (CHOICE[key], revealed)
            row = min(row + 1, PROMPTS)
    return made


@pytest.fixture(scope="module")
def compared(trained, sft_zero0, tmp_path_factory):
    """The page: an SFT model (the parallelism tests' ZeRO-0 SFT run) against a quick-start-like model."""
    sft, base = sft_zero0("true").check().output_dir, trained("zero3", "fp32").check().output_dir
    root = tmp_path_factory.mktemp("judging")
    prompts = root / "prompts.jsonl"
    lines = (REPO / "eval_tasks" / "data" / "tiny_instructions.jsonl").read_text().splitlines()
    prompts.write_text("\n".join(lines[:PROMPTS]) + "\n")
    out = tool_in_process("evaluate", sft, "--samples", prompts, "--compare", base, "--samples_output",
                          root / "page", *DECODING)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return {"sft": str(sft), "base": str(base), "root": root, "prompts": prompts, "page": root / "page"}


@pytest.fixture(scope="module")
def exports(compared):
    root = compared["root"]
    ann, ann_seen, _ = judge_in_browser(Path(f"{compared['page']}.html"), "ann", ANN, root / "ann")
    bob, _, bob_keys = judge_in_browser(Path(f"{compared['page']}.html"), "bob", BOB, root / "bob")
    return {"ann": ann, "bob": bob, "ann_seen": ann_seen, "bob_keys": bob_keys}


def test_the_export_holds_the_keys_pressed_unblinded_to_the_right_models(compared, exports):
    records = read_records(f"{compared['page']}.jsonl")
    page, labels = page_id(records), [compared["sft"], compared["base"]]
    lines = [json.loads(x) for x in exports["ann"].read_text().splitlines()]
    want = expected_choices(ANN)
    assert [x["row"] for x in lines] == sorted(want) and len(want) == 11 and 7 not in want  # row 7 skipped
    lefts = set()
    for x in lines:
        left, right = blind_order(page, x["row"], labels)
        assert (x["left"], x["right"], x["page"], x["judge"]) == (left, right, page, "ann")
        assert (x["choice"], x["revealed"]) == want[x["row"]]
        assert x["prompt"] == rows_of(records)[0][x["row"] - 1]["prompt"]
        lefts.add(left)
    assert lefts == set(labels)  # the sides really were shuffled: each model sat on the left somewhere
    assert want[3] == ("both_bad", False)  # "k" went back and the second choice replaced the first
    # the reload lost nothing: 5 choices, the name, the highlighted buttons, and the row she was on
    seen = exports["ann_seen"]
    assert seen["progress"] == f"5 / {PROMPTS} judged" and seen["name"] == "ann" and seen["current"] == "6"
    assert seen["chosen"] == ["left", "right", "both_bad", "left", "right"]
    assert seen["names_shown"] and exports["ann"].name == f"judgments-ann-{page}.jsonl"


def test_win_rates_agreement_and_position_bias_equal_a_reference(compared, exports):
    from scipy.stats import binomtest, bootstrap

    stem = compared["page"]
    out = tool_in_process("evaluate", compared["sft"], "--samples_output", stem, "--judgments", exports["ann"],
                          exports["bob"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(Path(f"{stem}.judgments.json").read_text())
    records = read_records(f"{stem}.jsonl")
    page, labels = page_id(records), [compared["sft"], compared["base"]]
    made = {"ann": expected_choices(ANN), "bob": expected_choices(exports["bob_keys"])}
    assert len(made["bob"]) == PROMPTS

    def outcome(row, choice):  # un-blinded: the model that won, or tie / both_bad
        return dict(zip(("left", "right"), blind_order(page, row, labels))).get(choice, choice)

    def sft_score(row, choice):  # a tie or both-bad is half a win
        return {labels[0]: 1.0, labels[1]: 0.0}.get(outcome(row, choice), 0.5)

    per_row = {}
    for judge in made.values():
        for row, (choice, _) in judge.items():
            per_row.setdefault(row, []).append(sft_score(row, choice))
    scores = np.array([np.mean(per_row[r]) for r in sorted(per_row)])
    ref = bootstrap((scores,), np.mean, n_resamples=10_000, method="percentile", rng=np.random.default_rng(0))
    sft = summary["win_rates"][labels[0]]
    assert summary["prompts_judged"] == PROMPTS and summary["judgments"] == 23
    assert sft["rate"] == pytest.approx(scores.mean(), abs=1e-12)
    assert (sft["low"], sft["high"]) == pytest.approx(tuple(ref.confidence_interval), abs=1e-12)
    assert summary["win_rates"][labels[1]]["rate"] == pytest.approx(1 - scores.mean(), abs=1e-12)
    # agreement on the 11 rows both judged: the same un-blinded outcome
    shared = sorted(set(made["ann"]) & set(made["bob"]))
    same = sum(outcome(r, made["ann"][r][0]) == outcome(r, made["bob"][r][0]) for r in shared)
    agreement = summary["agreement"][0]
    assert agreement["shared"] == len(shared) and agreement["percent"] == pytest.approx(100 * same / len(shared))
    # position bias: how often the left column won among the decisive judgments
    decisive = [c for judge in made.values() for c, _ in judge.values() if c in ("left", "right")]
    k = decisive.count("left")
    assert summary["position"]["decisive"] == len(decisive) and summary["position"]["left_won"] == k
    assert summary["position"]["p_value"] == pytest.approx(binomtest(k, len(decisive), 0.5).pvalue)
    assert summary["revealed"] == 4
    # printed, and on the rebuilt page above the table
    assert "win rate" in out.stdout.lower() and "kappa" in out.stdout.lower()
    html = Path(f"{stem}.html").read_text()
    assert "<h2>Judgments</h2>" in html and f"{100 * scores.mean():.1f} %" in html


def test_the_judged_pairs_train_dpo_and_the_result_is_compared_again(compared, exports, tmp_path):
    stem, pairs = compared["page"], tmp_path / "pairs.jsonl"
    judged = ("--samples_output", stem, "--judgments", exports["bob"])  # his consistent preference
    # cut answers stay out of `chosen`; these 8-step models rarely stop within 12 tokens, so say which to keep
    out = tool_in_process("evaluate", compared["sft"], *judged, "--preferences_out", tmp_path / "strict.jsonl")
    records = read_records(f"{stem}.jsonl")
    rows = rows_of(records)[0]
    strict = (
        [json.loads(x) for x in (tmp_path / "strict.jsonl").read_text().splitlines()] if out.returncode == 0 else []
    )
    cut = {r["output"] for r in records if r["ended"] is False}
    assert all(p["chosen"][0]["content"] not in cut for p in strict), "a cut answer was written as chosen"
    out = tool_in_process("evaluate", compared["sft"], *judged, "--preferences_out", pairs, "--keep_truncated")
    assert out.returncode == 0, out.stderr[-3000:]
    written = [json.loads(x) for x in pairs.read_text().splitlines()]
    # what --keep_truncated adds is exactly the pairs whose chosen answer was cut
    assert len(written) - len(strict) == sum(p["chosen"][0]["content"] in cut for p in written) and written
    for p in written:  # TRL's conversational format, each answer one of the page's two for that prompt
        row = next(r for r in rows if [{"role": "user", "content": r["prompt"]}] == p["prompt"])
        assert {p["chosen"][0]["content"], p["rejected"][0]["content"]} == set(row["outputs"].values())
        assert p["chosen"][0]["role"] == p["rejected"][0]["role"] == "assistant"

    args = [*FAST, "--deepspeed", *CONFIGS["zero2"], "--model_name_or_path", compared["sft"], "--objective", "dpo"]
    args += ["--dataset_name", str(pairs), "--block_size", "128", "--per_device_train_batch_size", "2"]
    args += ["--learning_rate", "1e-3", "--validation_split_percentage", "0", "--verify_export"]
    run = launch(args, tmp_path / "dpo", launcher="forked").check()
    steps = [r for r in run.records if "rewards/accuracies" in r]
    assert len(steps) == 8 and all(np.isfinite(r["loss"]) for r in steps), run.log[-3000:]
    # it learned the judges' preference: chosen above rejected on the pairs it trained on, by a margin
    assert steps[0]["rewards/accuracies"] == 0.0 and steps[-1]["rewards/accuracies"] >= 0.75
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < steps[0]["loss"]
    assert next(r["export_max_abs_logit_diff"] for r in run.records if "export_max_abs_logit_diff" in r) <= 1e-5
    # and compared again: the DPO model beside the SFT model it started from, a new page to judge
    again = tool_in_process("evaluate", run.output_dir, "--samples", compared["prompts"], "--compare",
                            compared["sft"], "--samples_output", tmp_path / "again", *DECODING)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    new = read_records(tmp_path / "again.jsonl")
    assert page_id(new) != page_id(records) and {r["column"] for r in new} == {str(run.output_dir), compared["sft"]}
    assert "judging-data" in (tmp_path / "again.html").read_text()


@pytest.mark.parametrize(
    "case, message",
    [
        ("not-json", "not JSON"),
        ("other-page", "another page"),
        ("same-judge", "are both exports of judge"),
        ("unknown-row", "a prompt this page does not have"),
    ],
)
def test_bad_judgment_files_are_one_line_and_exit_2(compared, exports, tmp_path, case, message):
    ann = exports["ann"].read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    files = [bad]
    if case == "not-json":
        bad.write_text(ann[0] + "\n{not json\n")
    elif case == "other-page":
        bad.write_text("".join(json.dumps(dict(json.loads(x), page="0123456789abcdef")) + "\n" for x in ann))
    elif case == "same-judge":
        bad.write_text("".join(json.dumps(dict(json.loads(x), judge=" Ann")) + "\n" for x in ann))
        files = [exports["ann"], bad]
    else:
        bad.write_text(json.dumps(dict(json.loads(ann[0]), row=PROMPTS + 5)) + "\n")
    out = tool_in_process("evaluate", compared["sft"], "--samples_output", compared["page"], "--judgments", *files)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preferences_out", "p.jsonl"], "--preferences_out needs --judgments FILES"),
        (["--judgments", "a.jsonl", "--samples", "prompts.jsonl"], "--judgments reads a page already judged"),
        (["--judgments", "a.jsonl", "--samples_output", "nowhere/page"], "no page at nowhere/page.jsonl"),
    ],
)
def test_judgment_options_that_do_not_fit_are_one_line_before_anything_is_read(args, message, tmp_path):
    out = tool_in_process("evaluate", tmp_path / "model", *args)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {message}") and out.stderr.count("\n") == 1
