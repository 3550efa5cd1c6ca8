"""Preference optimisation (`--objective dpo`): DPO and its relatives (preference/losses.py) on prompt/chosen/
rejected pairs (preference/data.py), each prompt computed once (pairs.py), against reference log-probs computed
once by the run's own engine (reference.py). docs/preference.md.

Its modules are imported when a preference run uses them, so that a language-modelling run never loads them.
"""

from __future__ import annotations

from zero_recipes.errors import ConfigError


class Preference:
    name = "dpo"
    rows = "pairs"  # what a batch counts (per_device_train_batch_size); a pair's prompt + answers <= block_size

    def __init__(self, cfg):
        self.cfg = cfg

    def check(self, cfg, active_modes: dict) -> None:
        """The options, the data's rules, and what the shared-prompt layout needs."""
        from zero_recipes.preference import data, losses, prepare

        losses.check_options(cfg.loss_type, cfg.loss_weights, cfg.beta, cfg.label_smoothing, cfg.simpo_gamma,
                             cfg.cpo_alpha)  # fmt: skip
        prepare.check(cfg)
        data.check_truncation(cfg.max_length, cfg.truncation_mode)
        if cfg.attn_implementation != "sdpa":
            raise ConfigError(
                f"--objective dpo with --attn_implementation {cfg.attn_implementation}: the pairs' shared-prompt "
                "attention runs through sdpa; use --attn_implementation sdpa"
            )

    def check_data(self, cfg, sample: bool) -> list[str]:
        """The file found (data.check); its rows are read against the preference formats by dry_run_lines, not
        against the SFT formats data.check samples with."""
        from zero_recipes import data

        return data.check(cfg, sample=False)

    def check_inputs(self, plan) -> None:
        """What needs the resolved plan, before any process group: a given reference file's model."""
        from zero_recipes.preference import reference

        reference.check_given_file(plan.cfg, plan.precision)

    def prepare_data(self, cfg, tok, log):
        from zero_recipes.preference import prepare

        return prepare.prepare(cfg, tok, log)

    def runner(self, engine, plan, rank: int, prepared, resumed: bool, log):
        from zero_recipes.preference import reference
        from zero_recipes.preference.runner import PreferenceRunner

        runner = PreferenceRunner(engine, plan, rank, prepared)
        reference.prepare(runner, plan, rank, resumed, log)
        return runner

    def dry_run_lines(self, cfg, load_tokenizer) -> list[str]:
        """One pair of the set, rendered with what is trained (--dry_run): with the model's tokenizer, or the
        embedded one a tiny recipe's output will hold before that recipe ran; none when it cannot be read."""
        import dataclasses
        from pathlib import Path

        from zero_recipes import data as zr_data
        from zero_recipes.modeling.hub import EMBEDDED_OUTPUTS
        from zero_recipes.preference import data

        name = cfg.model_name_or_path
        if name and Path(name) in EMBEDDED_OUTPUTS and not Path(name).exists():
            return data.sample_lines(
                cfg, lambda: zr_data.load_tokenizer(dataclasses.replace(cfg, model_name_or_path=None))
            )
        return data.sample_lines(cfg, load_tokenizer)
