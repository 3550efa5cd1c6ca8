"""The early warning for a fine-tune whose learning rate is too high for its pretrained weights: the loss climbs
well above where it started within the first steps (issue 47: a pretrained 135M model went from 3.86 to 4.90 in
3 steps at the demo's 2e-3, and nothing said so). One line, once, naming the learning rate.

The rule (docs/troubleshooting.md): in a launch that starts a fine-tune (pretrained weights, full or LoRA, from step
0), a logged loss more than max(RISE x the first logged loss, MIN_RISE) above that first one, at a step up to
max(WATCHED_RECORDS x logging_steps, twice the warmup). Logged losses are window means over `logging_steps`, but
with `--logging_steps 1` each is one batch, and a fine-tune's loss is flat to falling, so the margin is set above
batch noise: 20 % of the loss, and at least 0.3 nats where the loss is already low (an SFT's answer tokens at 0.5,
where a few hard answers move a small batch's mean). A warmup can hold the rate low past the first records, so the
watch lasts until twice its end. From-scratch runs are not watched: their early loss can spike and recover (the
100M from-scratch benchmark in benchmarks/parallel-2026-12-01.json goes 8.48 -> 9.91 at step 4 -> 7.24 at step 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zero_recipes.config import lr_defaults
from zero_recipes.ds import intake as ds_config

RISE = 0.2
"""Of the first logged loss: the measured case rose 27 % in 3 steps."""
MIN_RISE = 0.3
"""Nats: below this a rise is within the batch noise of a low loss."""
WATCHED_RECORDS = 20


@dataclass
class LossRiseWatch:
    learning_rate: float
    row: lr_defaults.Defaults
    """The table's row for what is trained: what the learning rate is compared with in the warning."""
    last_step: int
    """Records after this step are not watched; 0: none are (not a fine-tune, or a resumed launch)."""
    first: Optional[tuple[int, float]] = None
    fired: bool = False

    @classmethod
    def for_launch(cls, plan, start_step: int) -> LossRiseWatch:
        """The watch for a launch of `plan` that starts at `start_step`. A resumed launch's first loss is not where
        the fine-tune started, so only a launch from step 0 is watched."""
        cfg = plan.cfg
        row = lr_defaults.defaults_for(cfg)
        fine_tune = row is not lr_defaults.FROM_SCRATCH and start_step == 0
        warmup = ds_config.warmup_steps(cfg, plan.total_steps)
        last = max(WATCHED_RECORDS * cfg.logging_steps, 2 * warmup) if fine_tune else 0
        return cls(cfg.learning_rate, row, last)

    def observe(self, step: int, loss: float) -> Optional[str]:
        """The warning line the first time a logged loss breaks the rule, else None."""
        if self.fired or step > self.last_step:
            return None
        if self.first is None:
            self.first = (step, loss)
            return None
        first_step, first = self.first
        if loss - first <= max(RISE * first, MIN_RISE):
            return None
        self.fired = True
        return (
            f"warning: the loss rose from {first:.4f} at step {first_step} to {loss:.4f} at step {step} "
            f"(+{loss / first - 1:.0%}) in the first steps of {self.row.trained}: {self.advice()} "
            "(docs/troubleshooting.md)"
        )

    def advice(self) -> str:
        lr, default = self.learning_rate, self.row.learning_rate
        if lr == default:
            return f"learning_rate {lr!r}, its default, may be too high for this model; lower --learning_rate"
        return f"learning_rate {lr!r} may be too high for it (its default is {default!r}); lower --learning_rate"
