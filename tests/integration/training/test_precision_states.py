"""What is particular to the precision rows of the contract (tests/contract.py `precision_rows`): the bytes
their optimizer states take, measured in the runs' own checkpoints, equal the memory estimate's; and --dry_run
names the precision truthfully. Their losses against the fp32 ZeRO-0 run, their resume and export are the
contract's columns, read from the same runs (conftest's mode_run)."""

from __future__ import annotations

import json

import pytest
import torch

from contract import MODES
from helpers import dry_run_in_process

PRECISION_ROWS = [m for m in MODES if m.family == "precision"]
BYTES = {torch.float32: 4, torch.bfloat16: 2}
DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _tensors(node):
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _tensors(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _tensors(v)


def measured_states(step_dir, rank: int) -> dict:
    """One rank's master partition and Adam moments as its checkpoint holds them, which is as DeepSpeed held them
    (torch.save keeps each tensor's dtype): ZeRO-1/2's `single_partition_of_fp32_groups` and the base optimizer's
    state, ZeRO-3's `fp32_flat_groups` and its optimizer's state (the names say fp32 whatever the dtype)."""
    [path] = step_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    sd = saved["optimizer_state_dict"]
    if "single_partition_of_fp32_groups" in sd:
        masters, state = sd["single_partition_of_fp32_groups"], sd["base_optimizer_state"]["state"]
    else:
        masters, state = sd["fp32_flat_groups"], sd["optimizer_state_dict"]["state"]
    moments = [t for s in state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {
        "master_bytes": sum(t.numel() * BYTES[t.dtype] for t in masters),
        "optimizer_bytes": sum(t.numel() * BYTES[t.dtype] for t in moments),
        "master_dtype": {DTYPE[t.dtype] for t in masters},
        "moment_dtype": {DTYPE[t.dtype] for t in moments},
        "ds_config": saved["ds_config"],
    }


@pytest.mark.parametrize("mode", PRECISION_ROWS, ids=lambda m: m.name)
def test_optimizer_state_bytes_measured_equal_the_estimate(mode, mode_run):
    """bf16_states.json: 2 B of master weight and 4 B of moments per parameter, over the ranks (6 B, the issue's
    "about 6 bytes a parameter" with offload, where they live on the host); autocast.json: fp32's 4 + 8."""
    from transformers import AutoConfig

    from zero_recipes.memory.activations import Activations
    from zero_recipes.memory.estimate import Launch, Precomputed, estimate

    run = mode_run(mode).check()
    step = run.output_dir / "checkpoints" / "step-8"
    ranks = [measured_states(step, r) for r in range(mode.nproc)]
    ds = ranks[0]["ds_config"]  # the resolved config the run trained with
    config = AutoConfig.from_pretrained(run.output_dir)
    nothing = Precomputed(activations=Activations(0, 0, "not traced"))  # only the states are compared
    e = estimate(config, ds, Launch(num_gpus=mode.nproc, accelerator="cpu"), precomputed=nothing)
    want = e.optimizer_states
    for got in ranks:
        assert got["master_dtype"] == {want["master_dtype"]} and got["moment_dtype"] == {want["moment_dtype"]}, got
        # the model's 1,787,008 parameters split evenly over 2 ranks: no padding, so equal to the byte
        assert got["master_bytes"] == want["master_bytes"] and got["optimizer_bytes"] == want["optimizer_bytes"], (
            got,
            want,
        )
    assert want["where"] == ("host" if "offload" in mode.name else "device")
    per_param = (want["master_bytes"] + want["optimizer_bytes"]) * mode.nproc / e.num_params
    assert per_param == (6 if mode.name.startswith("bf16_states") else 12)


@pytest.mark.parametrize(
    "fragments,says",
    [
        (("zero2.json", "bf16_states.json"), "bf16 with bf16 master weights and optimizer states"),
        (("zero3.json", "autocast.json"), "bf16 autocast, fp32 parameters and master weights"),
    ],
    ids=["bf16_states", "autocast"],
)
def test_dry_run_names_the_precision(fragments, says):
    out = dry_run_in_process("--deepspeed", *(f"ds_configs/{f}" for f in fragments), "--max_steps", "2")
    assert f"note: precision: {says}" in out, out[-2000:]
    start = out.index("{", out.index("resolved DeepSpeed config"))
    resolved = json.loads(out[start : out.index("\n}\n", start) + 2])
    if "autocast" in fragments[1]:
        assert resolved["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not resolved["bf16"]["enabled"]
    else:
        assert resolved["bf16"]["bf16_optimizer_states"] and resolved["bf16"]["bf16_master_weights_and_grads"]
