"""Mixtures of experts trained for real on 2 CPU ranks: every ZeRO stage and DeepSpeed AutoEP's expert
parallelism against the shared ZeRO-0 run, the balancing loss in the gradient, resume after a kill, the export.

Every run trains the baseline's global batch: 2 ranks x micro 4, each rank its own rows (the data order
shards by rank), so the two ranks route different tokens to different experts in every step. That is the
case that hangs ZeRO-3 when experts are separate modules; transformers 5 packs a layer's experts into 3-D
parameters, so every rank gathers all of them (moe.py). The balancing loss is on with a coefficient large
enough to move the losses (0.05), so a run that dropped it would fail the parity checks.
"""

from __future__ import annotations

import json

import pytest

import export_memory
from helpers import CONFIGS, FAST, at_step_4, export_diff, fault_env, launch, refusal, remove_shm, step_losses
from zero_recipes.config.shipped import EXPERT_PARALLEL, SEQUENCE_PARALLEL

EP2 = EXPERT_PARALLEL[2]
PARITY = 1e-5  # fp32 per-step losses and export logits; measured max 9.5e-7 (losses)
COEF = 0.05
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 4096}
SHAPE |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
MIXTRAL = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **SHAPE}
MOE = ["--model_config", json.dumps(MIXTRAL), "--router_aux_loss_coef", str(COEF)]

# the other families: Qwen2-MoE (a gated shared expert beside the routed ones) and DeepSeek-V3 (a shared expert,
# sigmoid routing in groups, a dense first layer, no balancing loss in transformers: a routing bias instead)
FAMILIES = {
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    | {"shared_expert_intermediate_size": 48, **SHAPE},
    "deepseek_v3": {"model_type": "deepseek_v3", "n_routed_experts": 4, "num_experts_per_tok": 2}
    | {"moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}
    | {"q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
    | {**SHAPE, "num_key_value_heads": 4},
}

LAYOUTS = {  # name -> fragments; every one the baseline's 2 ranks x micro 4 (ZeRO-2's own is with EP2)
    "zero1": [*CONFIGS["zero1"]],
    "zero3": [*CONFIGS["zero3"]],
    "zero2+ep2": [*CONFIGS["zero2"], EP2],
    "zero3+ep2": [*CONFIGS["zero3"], EP2],
}


def moe_args(*fragments: str) -> list[str]:
    return FAST + ["--deepspeed", *fragments, *MOE, "--save_steps", "4"]


@pytest.fixture(scope="module")
def moe_zero0(shared_runs):
    return shared_runs.get("moe-zero0", moe_args(*CONFIGS["zero0"]), launcher="forked").check()


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    runs = {}

    def get(name: str):
        if name not in runs:
            out = tmp_path_factory.mktemp(name.replace("+", "-")) / "run"
            # each rank's export gather is measured too (tests/export_memory.py)
            runs[name] = export_memory.launch(moe_args(*LAYOUTS[name]) + ["--verify_export"], out).check()
        return runs[name]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_zero_stage_and_expert_parallelism_match_zero0_with_ranks_routing_differently(name, moe_run, moe_zero0):
    run = moe_run(name)
    got, want = step_losses(run), step_losses(moe_zero0)
    assert sorted(got) == list(range(1, 9))
    assert max(abs(got[s] - want[s]) for s in got) <= PARITY, (got, want)
    aux = [r["aux_loss"] for r in run.records if "loss" in r]
    assert len(aux) == 8 and all(a >= 1.0 for a in aux)  # Switch's loss is 1 at perfect balance, more otherwise
    assert f"balancing loss: router_aux_loss_coef {COEF:g} x aux_loss" in run.log
    assert "active per token (4 experts, 2 per token, 2 of 2 layers sparse)" in run.log
    if "ep2" in name:
        assert "experts split 2 ways" in run.log and "each rank holds 2 of every layer's 4 experts" in run.log
    assert export_diff(run) <= PARITY  # every rank's experts back in the HF layout, reloaded by from_pretrained


def test_the_balancing_loss_is_in_the_first_step_and_moves_every_later_one(moe_zero0, tmp_path):
    """Without it (coefficient 0) step 1's loss is the baseline's less COEF x its aux loss, exactly the term
    transformers adds; from step 2 the language loss itself differs, so the term reached the gradient."""
    args = FAST + ["--deepspeed", *CONFIGS["zero0"], "--model_config", json.dumps(MIXTRAL)]
    run = launch(args + ["--router_aux_loss_coef", "0"], tmp_path / "run", launcher="forked").check()
    got, want = step_losses(run), step_losses(moe_zero0)
    aux = {r["step"]: r["aux_loss"] for r in moe_zero0.records if "loss" in r}
    language_loss = {s: want[s] - COEF * aux[s] for s in want}  # the baseline's loss without the term
    assert got[1] == pytest.approx(language_loss[1], abs=1e-6)
    # Adam's first update is lr x sign(gradient): the term changes few signs, so step 2 is 4e-7 apart
    moved = [abs(got[s] - language_loss[s]) for s in range(3, 9)]
    assert min(moved) > 1e-5 and max(moved) > 1e-3, moved  # the router trained otherwise: the term had a gradient
    assert not any("aux_loss" in r for r in run.records)


def test_a_rank_killed_after_a_save_ends_the_job_and_the_relaunch_resumes_bit_for_bit(moe_run, tmp_path):
    full = moe_run("zero2+ep2")
    out = tmp_path / "run"
    args = moe_args(*LAYOUTS["zero2+ep2"])
    killed = launch(args, out, launcher="torchrun", env=fault_env(kill="after_save:4:1"))
    remove_shm(killed.port)
    assert killed.proc.returncode != 0
    again = launch(args, out, launcher="forked").check()
    assert f"resume: loaded {out / 'checkpoints' / 'step-4'} at step 4" in again.log
    got, want = step_losses(again), step_losses(full)
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]  # exact, not close


def test_an_expert_parallel_resume_on_another_layout_is_refused_in_one_line(moe_run, tmp_path):
    out = at_step_4(moe_run("zero2+ep2").output_dir, tmp_path / "run")
    args = moe_args(*CONFIGS["zero2"]) + ["--resume_from_checkpoint", "auto", "--output_dir", str(out)]
    line = refusal(*args, world=2)
    assert "resumes an expert-parallel run only on the layout it was saved with" in line
    assert (out / "checkpoints" / "step-4").is_dir()  # nothing of the run lost


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_expert_families_under_zero3_and_expert_parallelism_match_zero0(family, tmp_path):
    model = ["--model_config", json.dumps(FAMILIES[family]), "--max_steps", "4"]
    base = launch(FAST + ["--deepspeed", *CONFIGS["zero0"], *model], tmp_path / "zero0", launcher="forked").check()
    fragments = [*CONFIGS["zero3"], EP2]
    run = launch(FAST + ["--deepspeed", *fragments, *model, "--verify_export"], tmp_path / "ep", launcher="forked")
    got, want = step_losses(run.check()), step_losses(base)
    assert max(abs(got[s] - want[s]) for s in range(1, 5)) <= PARITY, (got, want)
    assert export_diff(run) <= PARITY  # the shared experts and the router under their HF names
    assert ("aux_loss" in run.records[0]) == (family == "qwen2_moe")  # DeepSeek-V3 balances by a routing bias


def test_sequence_parallel_splits_each_row_and_keeps_the_balancing_loss_of_the_whole_row(moe_zero0, tmp_path):
    """SP2 on 2 ranks is one replica training the baseline's 8 rows a step as micro 4 x 2, each row split over
    the SP group. train.py's loss adds the balancing loss with the per-expert sums all-reduced over the group
    (moe.BalancingLoss), so it is the whole rows' balancing loss: equal to transformers' own loss of one rank
    fed the same micro-batches. The language loss is the shared baseline's (the aux loss is not additive over
    rows, so it depends on how rows group into micro-batches: the baseline groups them by rank)."""
    batch = ["--gradient_accumulation_steps", "2"]
    args = FAST + ["--deepspeed", *CONFIGS["zero3"], SEQUENCE_PARALLEL[2], *MOE, *batch]
    run = launch(args, tmp_path / "sp", launcher="forked").check()
    assert "loss: computed by train.py" in run.log
    one_rank = launch(FAST + ["--deepspeed", *CONFIGS["zero0"], *MOE, *batch], tmp_path / "one", nproc=1).check()
    for key in ("loss", "aux_loss"):
        got, want = [{r["step"]: r[key] for r in x.records if "loss" in r} for x in (run, one_rank)]
        assert max(abs(got[s] - want[s]) for s in range(1, 9)) <= PARITY, (key, got, want)
    language = [
        {r["step"]: r["loss"] - COEF * r["aux_loss"] for r in x.records if "loss" in r} for x in (run, moe_zero0)
    ]
    assert abs(language[0][1] - language[1][1]) <= PARITY, language  # step 1: the same weights, the same rows


def test_export_tool_maps_each_expert_file_to_the_trained_model_and_refuses_zero3_in_one_line(moe_run, tmp_path):
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from helpers import REPO

    run = moe_run("zero2+ep2")
    tool = [sys.executable, "tools/export_hf.py"]
    proc = subprocess.run([*tool, str(run.output_dir), str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.randint(0, 1000, (2, 32))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = AutoModelForCausalLM.from_pretrained(run.output_dir).eval()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trained(ids).logits)
    zero3 = moe_run("zero3+ep2").output_dir
    proc = subprocess.run([*tool, str(zero3), str(tmp_path / "hf3")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "ZeRO-3 + expert-parallel checkpoint" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf3").exists()


def test_packed_sft_keeps_the_balancing_loss_under_expert_parallelism(tmp_path):
    """Packed chat rows (SFT's path: labels masked, the step normalised by its label tokens across ranks,
    transformers' loss with its aux term): ZeRO-2 + EP2 against ZeRO-0 on the same rows."""
    from helpers import SFT, SFT_ZERO0_BATCH

    args = FAST + [*SFT, "--packing", "true", *SFT_ZERO0_BATCH, *MOE, "--max_steps", "4"]
    base = launch(args + ["--deepspeed", *CONFIGS["zero0"]], tmp_path / "zero0", launcher="forked").check()
    run = launch(args + ["--deepspeed", *CONFIGS["zero2"], EP2], tmp_path / "ep", launcher="forked").check()
    for key in ("loss", "aux_loss"):
        got, want = [{r["step"]: r[key] for r in x.records if "loss" in r} for x in (run, base)]
        assert max(abs(got[s] - want[s]) for s in range(1, 5)) <= PARITY, (key, got, want)
    ev = [[r for r in x.records if "eval_loss" in r][-1] for x in (run, base)]
    assert abs(ev[0]["eval_loss"] - ev[1]["eval_loss"]) <= PARITY


@pytest.fixture(scope="module")
def per_expert_checkpoint(tmp_path_factory):
    """tests/remote_code/per_expert_moe.py saved as a hub checkpoint with its code, and the embedded tokenizer."""
    import importlib.util
    import sys

    from helpers import REPO
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import builtin_tokenizer_dir

    spec = importlib.util.spec_from_file_location(
        "per_expert_moe", REPO / "tests" / "remote_code" / "per_expert_moe.py"
    )
    code = importlib.util.module_from_spec(spec)
    sys.modules["per_expert_moe"] = code  # transformers copies the module's file beside the weights
    spec.loader.exec_module(code)
    code.PerExpertMoeConfig.register_for_auto_class()
    code.PerExpertMoeForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    __import__("torch").manual_seed(0)
    where = tmp_path_factory.mktemp("per-expert") / "model"
    code.PerExpertMoeForCausalLM(code.PerExpertMoeConfig()).save_pretrained(where)
    return ["--model_name_or_path", str(where), "--trust_remote_code", "true"] + [
        "--tokenizer_name_or_path",
        str(builtin_tokenizer_dir(TrainConfig())),
    ]


def test_experts_kept_as_separate_modules_are_gathered_whole_under_zero3(per_expert_checkpoint, tmp_path):
    """8 experts, top-1, 16 tokens per rank and step, each rank its own rows: in every step some expert gets
    tokens on one rank and none on the other. As separate modules ZeRO-3 gathers it on one rank only. Measured
    without the leaf: "Received data size doesn't match expected size. Is there a distributed collective
    mismatch" (gloo's form of the NCCL hang). train.py finds the block's `experts` ModuleList and makes the
    block a leaf (DeepSpeed's set_z3_leaf_modules): the run completes with ZeRO-0's losses. Parameters below
    DeepSpeed's persistence threshold are never partitioned, so the fragment sets it to 0 (real experts are
    far above its 1e5 elements)."""
    partitioned = tmp_path / "partition-every-parameter.json"
    partitioned.write_text('{"zero_optimization": {"stage3_param_persistence_threshold": 0}}')
    args = FAST + [
        *per_expert_checkpoint,
        "--max_steps",
        "4",
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "1",
    ]
    base = launch(args + ["--deepspeed", *CONFIGS["zero0"]], tmp_path / "zero0", launcher="forked").check()
    zero3 = ["--deepspeed", *CONFIGS["zero3"], str(partitioned)]
    run = launch(args + zero3, tmp_path / "zero3", launcher="forked", timeout=300).check()
    assert "moe: PerExpertMoeBlock keep experts as separate modules" in run.log
    got, want = step_losses(run), step_losses(base)
    assert max(abs(got[s] - want[s]) for s in range(1, 5)) <= PARITY, (got, want)


def test_the_expert_parallel_export_leaves_the_experts_on_rank_0_alone(moe_run):
    """What each rank allocates while the export gathers every rank's experts (tests/export_memory.py: the CPU
    allocator's own count) under ZeRO-2 + EP2: rank 0 holds the state dict it writes and about a layer's experts
    more while it converts them; rank 1 sends its experts as they are and keeps nothing. Measured before the fix
    (an all-gather per layer, every rank keeping every layer's experts until the export returned): rank 1
    peaked at 835,584 bytes, 1.4x all the experts; for Qwen3-30B-A3B that was about 57 GB on every rank."""
    writer, sender = export_memory.read(moe_run("zero2+ep2").output_dir, 2)
    layer = 3 * MIXTRAL["num_local_experts"] * MIXTRAL["intermediate_size"] * MIXTRAL["hidden_size"] * 4  # fp32
    assert writer["held"] == writer["written"] and sender["held"] == sender["written"] == 0, (writer, sender)
    assert sender["peak"] <= layer // 16, (sender, layer)  # no copy of its experts, let alone everyone's
    assert writer["peak"] <= writer["written"] + 2 * layer, (writer, layer)
