"""The contract's first column (tests/contract.py): every mode computes its ZeRO-0 baseline's fp32 losses
step by step on the same global batch, only the summation order differing, and clips the same gradient."""

import pytest

from contract import rows
from helpers import step_losses


@pytest.mark.parametrize("mode", rows("parity"), ids=lambda m: m.name)
def test_fp32_losses_match_zero0_on_the_same_global_batch(mode, mode_run, baseline_run):
    run, base = mode_run(mode).check(), baseline_run(mode).check()
    missing = [line for line in mode.says if line not in run.log]
    assert not missing, (missing, run.log[-3000:])
    got, want = step_losses(run), step_losses(base)
    assert sorted(got) == list(range(1, 9)) and got[1] == pytest.approx(want[1], abs=mode.parity), (got, want)
    assert max(abs(got[s] - want[s]) for s in got) <= mode.parity, (got, want)
    # clipping sees the whole gradient: every shard, stage and rank, replicated parts once
    norms = [{r["step"]: r["grad_norm"] for r in x.records if "loss" in r} for x in (run, base)]
    relative = {s: abs(norms[0][s] - norms[1][s]) / norms[1][s] for s in range(1, 9)}
    assert all(r <= mode.norm_parity for r in relative.values()), (
        f"bound {mode.norm_parity:.2e}: {list(relative.values())}"
    )
