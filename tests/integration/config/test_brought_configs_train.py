"""DeepSpeed JSONs in the shapes the HF docs, axolotl and LLaMA-Factory ship train unchanged: 2 steps on 2 CPU
ranks, with their own key spellings (field names, "bfloat16", deprecated names). Under torchrun's agent with
forked ranks (docs/dev/test-suite.md#launchers): the subject is the config; the quick start's config trains under the
deepspeed launcher in test_train_configs.py."""

import json

import pytest

from brought_configs import TRAINS
from helpers import launch

ARGS = ["--max_steps", "2", "--block_size", "64", "--per_device_train_batch_size", "4", "--logging_steps", "1"]
ARGS += ["--eval_steps", "0", "--save_steps", "0", "--max_eval_batches", "2"]
# what each run must show besides training: the spelling it used was understood, not dropped
EXPECT = {
    "axolotl-zero3-field-names": ("ZeRO stage 3", "renamed zero_optimization.max_live_parameters"),
    "axolotl-zero3-offload-all": ("ZeRO stage 3", "renamed zero_optimization.gather_16bit_weights_on_model_save"),
    "llamafactory-z3-offload": ("ZeRO stage 3", "top-level key 'monitor_config' is not read by DeepSpeed"),
    "old-bfloat16-block": ("ZeRO stage 2, bf16", 'renamed "bfloat16" to "bf16"'),
    "llamafactory-autotp": ("distributed: 2 ranks = 1 data-parallel x 2 tensor-parallel", "ZeRO stage 2"),
    "old-deprecated-names": (
        "ZeRO stage 3",
        "renamed zero_optimization.cpu_offload to zero_optimization.offload_optimizer",
    ),
}
EXTRA = {"old-bfloat16-block": ["--bf16", "true"]}


@pytest.mark.parametrize("name", list(TRAINS))
def test_brought_config_trains_unchanged(name, tmp_path):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(TRAINS[name], indent=2))
    run = launch(["--deepspeed", str(path), *ARGS, *EXTRA.get(name, [])], tmp_path / "out", launcher="forked")
    run.check()
    assert len(run.losses) == 2, run.log[-3000:]
    assert "Traceback" not in run.log
    for text in EXPECT.get(name, ()):
        assert text in run.log, run.log[-3000:]
    # the config DeepSpeed ran is the normalised one: one spelling per key, offload where the file asked for it
    used = json.loads((run.output_dir / "ds_config.json").read_text())
    zero = used.get("zero_optimization", {})
    assert "max_live_parameters" not in zero and "gather_16bit_weights_on_model_save" not in zero
    asked = json.dumps(TRAINS[name])
    if '"offload_optimizer"' in asked or '"cpu_offload": true' in asked:
        assert zero["offload_optimizer"]["device"] == "cpu"
