"""The estimate of a DPO run (--objective dpo, zero_recipes/memory/objective.py): its step traced as the runner takes
it (a row of pairs, each prompt once, the answers' logits whole), checked against a real DPO forward/backward; the
policy's states as for any run, and nothing for a reference model, which is never held (its log-probs are
computed once, before the first step)."""

import json

import pytest
import torch

from helpers import ESTIMATE_OVER, ESTIMATE_UNDER, fwd_bwd_peak_bytes, load_tool, small_llama, tool_in_process
from zero_recipes.memory import activation_bytes
from zero_recipes.memory.objective import REFERENCE, dpo_batch, shared_prompt_attention

# an 8B Llama-3.1 (128,256-token vocabulary) as recipes/llama-3.1-8b-dpo.yaml shapes it: 1 pair of 4096 tokens a GPU
SHAPE = ("--model", "recipes/configs/llama-3.1-8b.json", "--num_gpus", "8", "--micro_batch_size", "1",
         "--seq_len", "4096", "--gradient_checkpointing")  # fmt: skip
ANSWER_LOGITS = 4095 * 128_256  # K x V: the worst row's answer tokens (one-token prompt) x the vocabulary


def real_dpo_step(config, pairs: int, tokens: int, dtype, gc: bool) -> int:
    """Peak live bytes of one real DPO forward+backward through train.py's code (pairs.answer_logps with the
    shared-prompt attention), the model's output kept through the backward as PreferenceRunner keeps it."""
    from transformers import AutoModelForCausalLM

    from zero_recipes.preference.pairs import answer_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch, kept = dpo_batch(pairs, tokens), []

    def forward(m, _ids):
        ids = torch.randint(0, config.vocab_size, batch["input_ids"].shape)
        logps, out = answer_logps(m, dict(batch, input_ids=ids))
        kept.append(out)
        return logps.sum()

    with shared_prompt_attention():
        return fwd_bwd_peak_bytes(model, config, 1, 8, forward)


@pytest.mark.parametrize(
    "dtype,gc",
    [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)],
    ids=["bf16", "bf16-gc", "fp32"],
)
def test_dpo_activations_match_a_real_dpo_step(dtype, gc):
    config = small_llama()
    predicted = activation_bytes(config, 2, 256, dtype, gc, objective="dpo")
    assert predicted.method == "traced"
    real = real_dpo_step(config, 2, 256, dtype, gc)
    assert -ESTIMATE_UNDER <= predicted.bytes / real - 1 <= ESTIMATE_OVER, (predicted.bytes, real)


def estimate(stage: str, *extra) -> dict:
    proc = tool_in_process("estimate_memory", *SHAPE, "--deepspeed", f"ds_configs/{stage}.json",
                           "ds_configs/bf16.json", "--json", *extra)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_dpo_is_the_lm_estimate_but_its_loss_region_and_holds_no_reference_model(stage):
    """Against the LM run of the same shape with its loss untiled: the same states and buffers in every phase (the
    policy's alone: no second model), the activations apart only by the loss region, within 8 bytes per answer
    logit (measured: 6, the 16-bit logits kept through the backward beside their fp32 copy)."""
    dpo, lm = estimate(stage, "--objective", "dpo"), estimate(stage, "--tiled_loss", "false")
    for phase, p in dpo["phases"].items():
        q = lm["phases"][phase]
        assert (p["model_states_bytes"], p["buffers_bytes"]) == (q["model_states_bytes"], q["buffers_bytes"]), phase
    extra = (
        dpo["phases"]["forward_backward"]["activations_bytes"] - lm["phases"]["forward_backward"]["activations_bytes"]
    )
    assert 0 < extra <= 8 * ANSWER_LOGITS, extra / ANSWER_LOGITS
    assert any(note.startswith(REFERENCE) for note in dpo["notes"])


def test_dpo_is_far_below_the_policy_plus_a_second_full_model():
    """TRL's DPOTrainer holds a second model for the reference: under ZeRO-1/2 a whole 16-bit copy on every GPU
    (its prepare_deepspeed runs the reference at stage 0), 2 bytes a parameter, 14.96 GiB for 8B (under ZeRO-3 that
    copy is partitioned like the policy, 2/N bytes a parameter). Here the whole DPO cost over the LM run of the same
    shape is under a quarter of that copy."""
    dpo, lm = estimate("zero2", "--objective", "dpo"), estimate("zero2", "--tiled_loss", "false")
    second_model = 2 * dpo["num_params"]
    assert dpo["per_gpu"]["peak_bytes"] - lm["per_gpu"]["peak_bytes"] < second_model / 4
    assert dpo["per_gpu"]["peak_bytes"] < lm["per_gpu"]["peak_bytes"] + second_model


def test_the_runs_memory_line_says_no_reference_model_is_held():
    """train.py's log and --dry_run carry the estimate's one line (memory.for_run); a DPO run's says the reference
    is computed once."""
    from zero_recipes.memory import for_run
    from zero_recipes.memory.from_args import load

    tool = load_tool("estimate_memory")
    args = tool.parser().parse_args([*SHAPE, "--deepspeed", "ds_configs/zero3.json", "ds_configs/bf16.json"])
    for objective, said in (("dpo", True), ("lm", False)):
        args.objective = objective
        cfg, config, ds, _ = load(args, args.deepspeed, 8)
        estimate_, line = for_run(config, ds, cfg, 8)
        assert estimate_ is not None and line.startswith("memory: estimated peak"), line
        assert (REFERENCE in line) == said, line
