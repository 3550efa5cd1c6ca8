"""Ulysses sequence parallelism (DeepSpeed ALST) and the tiled loss, trained for real on 2 and 4 CPU ranks.

Every SP run trains the same rows per step as the ZeRO-0 run of the `trained` fixture (2 ranks x micro 4):
SP2 on 2 ranks is one data-parallel replica with micro 8, SP2 x DP2 on 4 ranks two with micro 4. Each rank
trains half of every row; attention all-to-alls to whole rows. The fp32 losses must match ZeRO-0's step
by step: only the summation order differs (measured: within 9.5e-7 over 8 steps). Those checks, resume, the
export tool and layout changes are the SP rows of the contract table (tests/contract.py); this file holds
what is particular to SP.
"""

from __future__ import annotations

import json
import math

import pytest

from contract import BY_NAME, MODES, micro
from helpers import (
    CONFIGS,
    FAST,
    SFT,
    SFT_ZERO0_BATCH,
    dry_run_in_process,
    export_diff,
    launch,
    one_error_line,
    refusal,
    step_losses,
    train_as_world,
)
from zero_recipes.config.shipped import SEQUENCE_PARALLEL

SP2 = SEQUENCE_PARALLEL[2]
PARITY = 1e-5  # fp32 per-step loss and export logits; measured max 9.5e-7 (losses)
# SFT: the loss is a sum over label tokens divided by their count, packed rows attend per example, and
# gradient checkpointing recomputes the all-to-alls: measured 2.4e-6 by step 8 against ZeRO-0.
SFT_PARITY = 2e-5

SP_ROWS = [m for m in MODES if m.family == "sp"]


@pytest.mark.parametrize("mode", SP_ROWS, ids=lambda m: m.name)
def test_tokens_per_sec_counts_each_row_once(mode, mode_run):
    """A replica's rows over the devices that trained them, not once per rank of the SP group."""
    run = mode_run(mode).check()
    rec = [r for r in run.records if "tokens_per_sec" in r][-1]
    assert rec["tokens_per_sec"] == pytest.approx(rec["tokens_per_sec_per_device"] * mode.nproc)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_sft_matches_zero0_losses_eval_and_exact_match_packed_or_not(packing, sft_zero0, tmp_path):
    """Packed rows keep each example apart under SP (sdpa per example); unpadded rows attend causally. The SP
    run also tiles its loss (50-token tiles, 2 accumulation steps) against ZeRO-0's untiled loss."""
    sft = SFT + ["--packing", packing, *SFT_ZERO0_BATCH]
    base = sft_zero0(packing).check()
    sp = launch(
        FAST + ["--deepspeed", *CONFIGS["zero3"], SP2, *sft, "--per_device_train_batch_size", "4"]
        + ["--loss_tile_tokens", "50"],
        tmp_path / "sp",
        launcher="forked",
    ).check()  # fmt: skip
    assert "loss: head and cross-entropy in tiles of 50 tokens" in sp.log
    got, want = step_losses(sp), step_losses(base)
    assert max(abs(got[s] - want[s]) for s in range(1, 9)) <= SFT_PARITY, (got, want)
    # eval runs whole rows without SP, each rank its own share: every row counted once
    ev_sp, ev_base = [[r for r in run.records if "eval_loss" in r][-1] for run in (sp, base)]
    assert abs(ev_sp["eval_loss"] - ev_base["eval_loss"]) <= SFT_PARITY
    assert ev_sp["eval_exact_match"] == ev_base["eval_exact_match"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_tiled_loss_equals_the_untiled_one_without_sp(tied, trained, tmp_path):
    """48-token tiles (6 a micro-batch) against the untiled loss. Tied: the head's weight is the embedding's,
    whose gradient, the tiles' and the embedding lookup's summed, must reach ZeRO once a backward. A backward
    per tile (DeepSpeed's sequence_tiled_compute) made ZeRO-2 assert that model.embed_tokens.weight was already
    reduced, and ZeRO-3 keep only its last reduction, the lookup's (a 0.41 higher loss by step 8). One rank,
    as on the GPU where ZeRO-2 failed; the untiled ZeRO-3 run is the reference (equal to ZeRO-2's, and 10x
    faster on one CPU rank)."""
    tiled_args = ["--loss_tile_tokens", "48"]
    if tied:
        tie = ["--model_config", json.dumps({"tie_word_embeddings": True})]
        one = {"nproc": 1, "launcher": "forked"}
        base = launch(FAST + ["--deepspeed", *CONFIGS["zero3"], *tie], tmp_path / "b", **one).check()
        runs = [
            launch(FAST + ["--deepspeed", *CONFIGS[z], *tiled_args, *tie], tmp_path / z, **one).check()
            for z in ("zero2", "zero3")
        ]
    else:
        base = trained("zero2", "fp32").check()
        runs = [
            launch(FAST + ["--deepspeed", *CONFIGS["zero2"], *tiled_args], tmp_path / "t", launcher="forked").check()
        ]
    want = step_losses(base)
    for tiled in runs:
        assert "in tiles of 48 tokens" in tiled.log and "in tiles" not in base.log
        got = step_losses(tiled)
        assert max(abs(got[s] - want[s]) for s in range(1, 9)) <= 1e-6, (got, want)


def test_tiled_mlp_trains_to_the_same_losses_under_zero3(tmp_path):
    """TiledMLP in 2 tiles per layer (hidden 16, 32 tokens per rank), ZeRO-3 gathering the MLP's weights once
    per tile: the same losses as the plain MLP."""
    narrow = ["--model_config", json.dumps({"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2})]
    args = FAST + ["--deepspeed", *BY_NAME["sp2-zero3"].args, *narrow]
    run = launch(args + ["--tiled_mlp", "true"], tmp_path / "tiled", launcher="forked").check()
    plain = launch(args, tmp_path / "plain", launcher="forked").check()
    assert "decoder MLPs run in tiles of 16 tokens" in run.log
    got, want = step_losses(run), step_losses(plain)
    assert max(abs(got[s] - want[s]) for s in range(1, 9)) <= PARITY, (got, want)


# ---- bad input: one line, exit 2, before any process group (a single process stands in for the ranks) ----


def test_an_sp_refusal_reaches_the_shell_as_one_line_and_exit_2():
    """A real process as rank 0 of 3 ranks; the other SP refusals are checked in-process below."""
    proc = train_as_world(3, "--deepspeed", "ds_configs/zero3.json", SP2)
    assert "3 rank(s) cannot split into sequence-parallel groups of 2" in one_error_line(proc) and proc.returncode == 2


@pytest.mark.parametrize(
    "world,args,expected",
    [
        (
            4,
            ["--deepspeed", "ds_configs/zero3.json", SEQUENCE_PARALLEL[4], "--model_config"]
            + [json.dumps({"num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 144})],
            "sequence_parallel_size = 4 and the model's 6 key-value heads",
        ),
        (2, ["--deepspeed", "ds_configs/zero3.json", SP2, "--block_size", "63"], "does not divide block_size 63"),
        (2, ["--deepspeed", "ds_configs/zero3.json", SP2, "--attn_implementation", "eager"], "kernel without an s x s"),
        (2, ["--deepspeed", "ds_configs/zero0.json", SP2], "with ZeRO-0"),
        (
            4,
            ["--deepspeed", "ds_configs/zero1.json", SP2, "ds_configs/tp2.json"],
            "does not combine AutoTP with Ulysses",
        ),
        (
            2,
            ["--deepspeed", "ds_configs/zero3.json", SP2, "--attn_implementation", "flex_attention"]
            + ["--dataset_name", "builtin:tiny-instructions"],
            "packed examples would attend to each other",
        ),
    ],
    ids=["kv-heads", "block", "eager", "zero0", "tp", "flex-packing"],
)
def test_an_sp_size_the_run_cannot_take_is_refused_in_one_line(world, args, expected):
    assert expected in refusal(*args, "--dry_run", world=world)


def test_dry_run_draws_the_mesh():
    out = dry_run_in_process("--deepspeed", "ds_configs/zero3.json", SEQUENCE_PARALLEL[4], "--model_config", json.dumps({"num_key_value_heads": 4}), world=8)  # fmt: skip
    assert "8 ranks = 2 data-parallel x 4 sequence-parallel" in out
    grid = out.split("a column per sequence-parallel index):\n", 1)[1].splitlines()[:3]
    assert [line.split() for line in grid] == [["sp", "0", "sp", "1", "sp", "2", "sp", "3"]] + [
        ["dp", str(d), *(str(4 * d + i) for i in range(4))] for d in range(2)
    ]


def test_bf16_packed_sft_trains_and_exports(tmp_path):
    args = FAST + [
        "--deepspeed",
        *CONFIGS["zero3"],
        SP2,
        "ds_configs/bf16.json",
        *micro(2),
        *SFT[:6],
    ]  # SFT rows, no checkpointing
    run = launch(args + ["--loss_tile_tokens", "50", "--verify_export"], tmp_path / "run", launcher="forked").check()
    got = step_losses(run)
    assert all(math.isfinite(x) for x in got.values()) and got[8] < got[1] - 0.5
    assert export_diff(run) <= 5e-2  # bf16: within a bf16 ulp of the logits (measured 0)
