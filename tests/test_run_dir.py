"""One run per output_dir: relaunching continues or finishes, another run is refused, resume seeks."""

import json
import shutil

from conftest import FAST, launch

ZERO2 = ["--deepspeed", "ds_configs/zero2.json"]


def test_relaunch_finishes_and_second_launch_uses_the_data_cache(tmp_path):
    out = tmp_path / "run"
    env = {"ZERO_RECIPES_CACHE": str(tmp_path / "cache")}  # a cold cache of its own
    first = launch(FAST + ZERO2, out, env=env).check()
    assert "tokenisation skipped" not in first.log and "cached at" in first.log
    n_records = len(first.records)
    again = launch(FAST + ZERO2, out, env=env).check()  # the quick start, run twice
    assert "tokenisation skipped" in again.log
    assert "resume: loaded" in again.log and "nothing left to train" in again.log
    assert len([r for r in again.records if "loss" in r]) == len(first.losses)  # no step trained twice
    assert len(again.records) >= n_records
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()


def test_different_run_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    launch(FAST + ZERO2 + ["--max_steps", "2"], out).check()
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    refused = launch(FAST + ZERO2 + ["--max_steps", "2", "--learning_rate", "1e-4"], out)
    assert refused.proc.returncode != 0
    assert "holds a different run (changed: learning_rate)" in refused.log
    assert "Traceback" not in refused.log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing of the old run lost
    over = launch(FAST + ZERO2 + ["--max_steps", "2", "--learning_rate", "1e-4", "--overwrite_output_dir"], out)
    assert "resume: loaded" not in over.check().log
    assert [r["step"] for r in over.records if "loss" in r] == [1, 2]


def test_resume_mid_run_continues_the_same_losses(tmp_path):
    """Train 8 steps saving at 4; then rewind a copy to step 4 and relaunch: steps 5-8 must repeat the
    uninterrupted run's losses (data order seeks, LR schedule and RNG are restored)."""
    full = launch(FAST + ZERO2 + ["--save_steps", "4", "--save_total_limit", "0"], tmp_path / "full").check()
    rewound = tmp_path / "rewound"
    shutil.copytree(full.output_dir, rewound)
    shutil.rmtree(rewound / "checkpoints" / "step-8")
    (rewound / "checkpoints" / "latest").write_text("step-4")
    lines = (rewound / "metrics.jsonl").read_text().splitlines()
    (rewound / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= 4))
    resumed = launch(FAST + ZERO2 + ["--save_steps", "4", "--save_total_limit", "0"], rewound).check()
    assert "resume: loaded" in resumed.log and "step-4 at step 4" in resumed.log
    after = {r["step"]: r["loss"] for r in resumed.records if "loss" in r and r["step"] > 4}
    ref = {r["step"]: r["loss"] for r in full.records if "loss" in r and r["step"] > 4}
    assert sorted(after) == [5, 6, 7, 8]
    assert max(abs(after[s] - ref[s]) for s in ref) <= 1e-6, (after, ref)
