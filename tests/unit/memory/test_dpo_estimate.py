"""The estimate of a DPO run (--objective dpo): the policy's states as for any run, its answers' logits whole
(bounded by the micro-batch's tokens: the loss region train.py's untiled loss would hold), and no reference model:
the reference's log-probs are computed once before the first step, so nothing is added for them."""

import re

from helpers import tool_in_process

ARGS = ("--model", "recipes/configs/llama-3.1-8b.json", "--deepspeed", "ds_configs/zero3.json", "ds_configs/bf16.json",
        "--num_gpus", "8", "--micro_batch_size", "2", "--seq_len", "4096", "--gradient_checkpointing")  # fmt: skip


def peak(*extra) -> float:
    proc = tool_in_process("estimate_memory", *ARGS, *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(re.search(r"peak per GPU: ([0-9.]+) GiB", proc.stdout).group(1)), proc.stdout


def test_dpo_is_the_untiled_loss_estimate_and_says_no_reference_model_is_held():
    dpo, text = peak("--objective", "dpo")
    untiled, _ = peak("--tiled_loss", "false")
    lm, _ = peak()
    assert dpo == untiled > lm  # the logits of a row's tokens whole, where the LM run tiles them
    assert "no reference model held" in text
