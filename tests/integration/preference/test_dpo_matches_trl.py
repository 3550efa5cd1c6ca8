"""train.py's DPO equals TRL's DPOTrainer step by step: the same fp32 model, pairs, hyperparameters and AdamW, a
batch that holds the whole set (so the order inside it does not matter), and the same losses and TRL's own
metrics (rewards/*, logps/*) for 4 steps. One launch per trainer with three loss types summed (sigmoid, ipo,
hinge, as TRL combines a list): a wrong term moves the sum. Each type alone is compared with TRL's code in
tests/unit/preference/test_preference_losses.py."""

import json

import pytest

from helpers import launch

PAIRS = 16
STEPS = 4
LOSSES = ["sigmoid", "ipo", "hinge"]
WEIGHTS = [1.0, 0.5, 0.25]
SAME = {"learning_rate": 1e-3, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0, "warmup_steps": 0, "seed": 42, "beta": 0.1}  # fmt: skip
LOGPS = ("logps/chosen", "logps/rejected")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
GAP = 1e-6  # relative, losses and log-probs: measured worst 1.5e-7 (fp32 summation order)
REWARD_GAP = 2e-6  # absolute: measured worst 6.2e-7


@pytest.fixture(scope="module")
def base_and_pairs(tmp_path_factory):
    """A pretrained-style tiny Llama (the embedded tokenizer and its chat template) and 16 pairs of the embedded
    preference set in TRL's conversational format."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import load_tokenizer
    from zero_recipes.data.builtin import preference_examples
    from zero_recipes.data.formats import ensure_chat_template
    from zero_recipes.modeling.model import TINY_LLAMA

    where = tmp_path_factory.mktemp("dpo-trl")
    tok = load_tokenizer(TrainConfig())
    ensure_chat_template(tok, lambda *a: None)  # what train.py gives the embedded tokenizer; TRL needs one too
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"} | {"vocab_size": len(tok)}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields)).save_pretrained(where / "base")
    tok.save_pretrained(where / "base")
    (where / "pairs.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in preference_examples(PAIRS)))
    return where


def trl_records(where) -> list[dict]:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(SAME["seed"])
    model = AutoModelForCausalLM.from_pretrained(where / "base", attn_implementation="sdpa")
    args = DPOConfig(
        output_dir=str(where / "trl"), per_device_train_batch_size=PAIRS, max_steps=STEPS, logging_steps=1,
        lr_scheduler_type="constant", optim="adamw_torch", loss_type=LOSSES, loss_weights=WEIGHTS,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, **SAME,
    )  # fmt: skip
    train = load_dataset("json", data_files=str(where / "pairs.jsonl"), split="train")
    trainer = DPOTrainer(model=model, args=args, train_dataset=train,
                         processing_class=AutoTokenizer.from_pretrained(where / "base"))  # fmt: skip
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


def ours(where) -> list[dict]:
    flags = ["--deepspeed", "ds_configs/zero0.json", "--objective", "dpo", "--model_name_or_path", str(where / "base"),
             "--dataset_name", str(where / "pairs.jsonl"), "--per_device_train_batch_size", str(PAIRS),
             "--validation_split_percentage", "0", "--max_steps", str(STEPS), "--logging_steps", "1",
             "--eval_steps", "0", "--save_steps", "0", "--lr_scheduler_type", "constant_with_warmup",
             "--optim", "adamw_torch", "--block_size", "256", "--loss_type", *LOSSES,
             "--loss_weights", *map(str, WEIGHTS), "--report_to", "none", "--warmup_ratio", "0"]  # fmt: skip
    for k, v in SAME.items():
        flags += [f"--{k}", str(v)]
    run = launch(flags, where / "ours", nproc=1, launcher="forked").check()
    return [r for r in run.records if "loss" in r]


def test_dpo_losses_and_rewards_equal_trls_step_by_step(base_and_pairs):
    theirs, mine = trl_records(base_and_pairs), ours(base_and_pairs)
    assert len(theirs) == len(mine) == STEPS
    relative = {m: max(abs(a[m] - b[m]) / abs(b[m]) for a, b in zip(mine, theirs)) for m in ("loss", *LOGPS)}
    # a reward is beta x (logps - reference logps): a difference of two ~90-sized fp32 sums, so its error is
    # absolute, beta x fp32's rounding of them (0.1 x 90 x 6e-8 = 5e-7), whatever the reward's own size
    absolute = {m: max(abs(a[m] - b[m]) for a, b in zip(mine, theirs)) for m in REWARDS}
    assert max(relative.values()) <= GAP and max(absolute.values()) <= REWARD_GAP, (relative, absolute)
    assert [r["rewards/accuracies"] for r in mine] == [r["rewards/accuracies"] for r in theirs]
    assert mine[-1]["loss"] < mine[0]["loss"]  # and it trains
