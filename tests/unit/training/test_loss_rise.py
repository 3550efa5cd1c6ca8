"""The early warning of a fine-tune whose loss climbs above where it started (zero_recipes/training/loss_rise.py)."""

from types import SimpleNamespace

from zero_recipes.config import lr_defaults
from zero_recipes.config.cli import parse_args
from zero_recipes.training.loss_rise import LossRiseWatch

DS = ["--deepspeed", "ds_configs/zero3.json"]


def watch(*argv: str, start_step: int = 0, total_steps: int = 200) -> LossRiseWatch:
    cfg, _ = parse_args(DS + list(argv))
    return LossRiseWatch.for_launch(SimpleNamespace(cfg=cfg, total_steps=total_steps), start_step)


def warnings(w: LossRiseWatch, losses, first_step: int = 1, every: int = 1) -> list[tuple[int, str]]:
    out = [(first_step + i * every, w.observe(first_step + i * every, loss)) for i, loss in enumerate(losses)]
    return [(step, line) for step, line in out if line]


# The measured case (issue 47): a pretrained 135M model at the demo's 2e-3, logging every step.
MEASURED = [3.86, 4.31, 4.90, 5.20, 5.60]


def test_fires_once_on_the_measured_rise_naming_the_learning_rate():
    fired = warnings(
        watch("--model_name_or_path", "org/m", "--learning_rate", "2e-3", "--logging_steps", "1"), MEASURED
    )
    assert len(fired) == 1 and fired[0][0] == 3  # at 4.90 (+27 %), not again at 5.20 or 5.60
    assert fired[0][1] == (
        "warning: the loss rose from 3.8600 at step 1 to 4.9000 at step 3 (+27%) in the first steps of full "
        "fine-tuning of a pretrained checkpoint: learning_rate 0.002 may be too high for it (its default is "
        "2e-05); lower --learning_rate (docs/troubleshooting.md)"
    )


def test_says_when_the_learning_rate_was_the_default():
    (step, line), *_ = warnings(watch("--model_name_or_path", "org/m", "--lora_r", "8"), MEASURED, every=10)
    assert "training LoRA/QLoRA adapters" in line and "learning_rate 0.0002, its default, may be too high" in line


def test_silent_on_healthy_fine_tunes():
    w = lambda: watch("--model_name_or_path", "org/m", "--logging_steps", "1")  # noqa: E731
    falling = [6.7, 5.1, 3.9, 2.4, 1.3, 0.8, 0.5, 0.35, 0.3, 0.25]  # an SFT onto a new format
    flat_noisy = [3.00, 3.25, 2.90, 3.40, 3.10, 2.80, 3.35, 3.05]  # continued pretraining, one batch a record
    low_noisy = [0.50, 0.65, 0.45, 0.78, 0.55]  # a low loss: +56 % is 0.28 nats, within batch noise
    for curve in (falling, flat_noisy, low_noisy):
        assert warnings(w(), curve) == [], curve


def test_only_the_first_steps_of_a_fine_tune_from_its_start_are_watched():
    measured = ("--model_name_or_path", "org/m", "--logging_steps", "1")
    # from scratch: the 100M benchmark's real early spike (benchmarks/parallel-2026-12-01.json) is no warning
    assert warnings(watch(), [8.48, 8.47, 7.72, 9.91, 8.00, 7.76, 7.49, 7.24]) == []
    assert warnings(watch("--model_name_or_path", "org/m", "--model_config", "{}"), MEASURED) == []  # random init
    assert warnings(watch(*measured, start_step=50), MEASURED, first_step=51) == []  # a resumed launch
    late = watch(*measured, "--warmup_steps", "5")  # watched to max(20 records x 1 step, 2 x 5 warmup) = 20
    assert late.last_step == 20 and warnings(late, [3.0] * 20 + [5.0]) == []  # the rise at step 21 is not early
    long_warmup = watch(*measured, "--warmup_ratio", "0.2", total_steps=1000)  # 200 warmup steps
    assert long_warmup.last_step == 400
    assert warnings(long_warmup, [3.0] + [2.9] * 30 + [4.0], every=10)[0][0] == 311


def test_the_rule_is_relative_with_a_floor():
    w = LossRiseWatch(1e-3, lr_defaults.FULL_FINE_TUNING, last_step=100)
    assert w.observe(1, 3.0) is None and w.observe(2, 3.59) is None  # under +20 %: within the margin
    assert w.observe(3, 3.61) is not None
    w = LossRiseWatch(1e-3, lr_defaults.FULL_FINE_TUNING, last_step=100)
    assert w.observe(1, 0.5) is None and w.observe(2, 0.79) is None  # +58 % but under 0.3 nats: the floor
    assert w.observe(3, 0.81) is not None
