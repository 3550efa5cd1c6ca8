"""The language-modelling objective: next-token loss on every token (pretraining) or on the answer tokens the
data masks (SFT). The default; preference optimisation is preference/objective.py. The run picks one in setup
(modes.OBJECTIVES, `plan.objective`), and train.py asks it for the data and the runner only."""

from __future__ import annotations

from zero_recipes import data


class LanguageModeling:
    name = "lm"
    rows = "sequences"  # what a batch counts

    def __init__(self, cfg):
        self.cfg = cfg

    def check(self, cfg, active_modes: dict) -> None:
        """Nothing beyond the options' own checks."""

    def check_data(self, cfg, sample: bool) -> list[str]:
        """data.check: every dataset found; with `sample` (--dry_run) its first rows checked against the format."""
        return data.check(cfg, sample)

    def check_inputs(self, plan) -> None:
        """Nothing: the data's checks are data.check's."""

    def prepare_data(self, cfg, tok, log):
        return data.prepare(cfg, tok, log)

    def runner(self, engine, plan, rank: int, prepared, resumed: bool, log):
        return plan.parallelism.runner(engine, plan, rank, prepared.sft)

    def dry_run_lines(self, cfg, load_tokenizer) -> list[str]:
        return []  # data.check's sample lines say it all
