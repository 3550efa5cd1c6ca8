"""The contract's layout column (tests/contract.py): resuming a row's step-4 checkpoint on another layout
(ranks, replicas, stages, parallel sizes, ZeRO stage) is either converted by train.py itself, and the losses
continue within the layout's bound, or refused in one line before any process group, with nothing of the
run changed."""

import pytest

from contract import mode_args, rows
from helpers import at_step_4, file_tree, launch, refusal, step_losses

CASES = [(mode, layout) for mode in rows("layout") for layout in mode.layouts]


@pytest.mark.parametrize("mode,layout", CASES, ids=[f"{m.name}: {x.id}" for m, x in CASES])
def test_a_resume_on_another_layout_is_converted_or_refused_in_one_line(mode, layout, mode_run, bases, tmp_path):
    full = mode_run(mode).check()
    out = at_step_4(full.output_dir, tmp_path / "run")
    args = mode_args(layout.args, bases) + ["--save_steps", "4", "--resume_from_checkpoint", "auto"]
    if layout.tol is None:
        before = file_tree(out)
        line = refusal(*args, "--output_dir", out, world=layout.nproc)
        assert all(words in line for words in layout.says), line
        assert file_tree(out) == before  # nothing of the run lost
        return
    launcher = "python" if layout.nproc == 1 else "forked"
    run = launch(args, out, nproc=layout.nproc, launcher=launcher).check()
    missing = [words for words in layout.says if words not in run.log]
    assert not missing, (missing, run.log[-3000:])
    got, want = step_losses(run), step_losses(full)
    assert sorted(got) == list(range(1, 9))
    assert max(abs(got[s] - want[s]) for s in range(5, 9)) <= layout.tol, (got, want)
