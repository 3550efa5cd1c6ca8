"""TensorBoard and W&B get the same scalars as metrics.jsonl, from rank 0 only; asking for a tracker that is
not there, or for an unknown one, is one line."""

import re

import pytest

from helpers import FAST, launch


def test_tensorboard_has_the_metrics_jsonl_scalars(trained):
    """TensorBoard is on by default: the shared 2-rank ZeRO-2 run wrote its event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracked_run = trained("zero2", "fp32").check()
    events = list((tracked_run.output_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # rank 0 writes; rank 1 does not
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    train = [r for r in tracked_run.records if "loss" in r]
    evals = [r for r in tracked_run.records if "eval_loss" in r]
    for tag, key, rows in (
        ("train/loss", "loss", train),
        ("train/lr", "lr", train),
        ("train/tokens_per_sec", "tokens_per_sec", train),
        ("eval/loss", "eval_loss", evals),
    ):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [r["step"] for r in rows], tag
        assert all(v == pytest.approx(r[key], rel=1e-6) for (_, v), r in zip(got, rows)), tag
    assert [r["step"] for r in train] == list(range(1, 9)) and [r["step"] for r in evals] == [8]


def test_wandb_offline_run_holds_the_final_metrics(tmp_path):
    tracked_run = launch(
        FAST
        + [
            "--max_steps",
            "3",
            "--deepspeed",
            "ds_configs/zero2.json",
            "--report_to",
            "all",
            "--run_name",
            "tracking-test",
        ],
        tmp_path / "run",
        launcher="python",
        env={"WANDB_MODE": "offline", "WANDB_PROJECT": "zero-recipes-tests"},
    ).check()
    runs = list((tracked_run.output_dir / "wandb").glob("offline-run-*"))
    run_id = (tracked_run.output_dir / "wandb_run_id").read_text().strip()
    assert len(runs) == 1 and runs[0].name.endswith(run_id) and list(runs[0].glob(f"run-{run_id}.wandb"))
    # W&B's own end-of-run summary (what the user reads in the console) carries the last logged values
    summary = tracked_run.log.split("Run summary:", 1)[1]
    last = [r for r in tracked_run.records if "loss" in r][-1]
    last_eval = [r for r in tracked_run.records if "eval_loss" in r][-1]
    for tag, value in (("train/loss", last["loss"]), ("eval/loss", last_eval["eval_loss"])):
        shown = float(re.search(rf"{re.escape(tag)} ([0-9.e+-]+)", summary).group(1))
        assert shown == pytest.approx(value, rel=1e-4), tag


def test_unknown_tracker_is_one_line(tmp_path):
    run = launch(
        FAST + ["--deepspeed", "ds_configs/zero2.json", "--report_to", "tensorbord"], tmp_path / "x", launcher="python"
    )
    errors = [x for x in run.proc.stderr.splitlines() if x.startswith("error:")]
    assert run.proc.returncode == 2 and len(errors) == 1 and "did you mean 'tensorboard'" in errors[0]
    assert "Traceback" not in run.log and not (tmp_path / "x").exists()
