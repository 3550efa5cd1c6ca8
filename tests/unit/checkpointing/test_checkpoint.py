"""Saving's bookkeeping without a process group: which checkpoints rotation keeps. Saves themselves, on 2 ranks:
tests/integration/checkpointing/ (test_damaged_checkpoints.py, test_storage_faults.py)."""

from __future__ import annotations

from zero_recipes.checkpointing.checkpoint import rotate


def test_rotation_keeps_the_checkpoint_a_resume_takes(tmp_path):
    """save_total_limit: after a save the newest N stay; before a save (N - 1, the tag being saved aside) the
    one `latest` names stays even when a newer, damaged one was passed over, so a failed save still leaves it."""
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 8):
        (ckpts / f"step-{step}").mkdir(parents=True)
    (ckpts / "latest").write_text("step-4")  # step-8 was damaged and passed over; step-9 is about to be saved
    rotate(tmp_path, 1, but="step-9")
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-4"]
    (ckpts / "step-9").mkdir()
    (ckpts / "latest").write_text("step-9")
    (ckpts / "step-5").mkdir()
    rotate(tmp_path, 2)
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-5", "step-9"]
