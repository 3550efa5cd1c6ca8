"""The contract's resume column (tests/contract.py): a run stopped after its step-4 checkpoint and launched
again repeats the uninterrupted run's losses for steps 5-8, bit for bit in fp32: the LR schedule, every rank's
RNG, the data position (no replayed batches) and the optimizer (torch AdamW, which resumes bitwise) restored.
"kill" rows SIGKILL a rank right after the save under torchrun and relaunch the same command; "step4" rows
relaunch from a copy of the run's step-4 checkpoint, the files such a kill leaves."""

import pytest

from contract import mode_args, rows
from helpers import at_step_4, fault_env, launch, remove_shm, step_losses

EXPORTS = ("model.safetensors", "adapter_model.safetensors")


@pytest.mark.parametrize("mode", rows("resume"), ids=lambda m: m.name)
def test_a_stopped_run_resumes_where_it_stopped(mode, mode_run, bases, tmp_path):
    args = mode_args(mode.args, bases) + ["--save_steps", "4"]
    out = tmp_path / "run"
    if mode.resume == "kill":
        killed = launch(args, out, nproc=mode.nproc, launcher="torchrun", env=fault_env(kill="after_save:4:1"))
        remove_shm(killed.port)
        assert killed.proc.returncode != 0 and (out / "checkpoints" / "latest").read_text() == "step-4"
        assert not any((out / name).exists() for name in EXPORTS)  # no export from a run that did not finish
        again = launch(args, out, nproc=mode.nproc, launcher="forked").check()
        assert any((out / name).is_file() for name in EXPORTS)
    else:
        at_step_4(mode_run(mode).check().output_dir, out)
        again = launch(args + ["--resume_from_checkpoint", "auto"], out, nproc=mode.nproc, launcher="forked").check()
    assert f"resume: loaded {out / 'checkpoints' / 'step-4'} at step 4" in again.log
    got, want = step_losses(again), step_losses(mode_run(mode).check())
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]  # exact, not close
