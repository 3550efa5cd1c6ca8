"""torchrun works like the deepspeed launcher; the exported model is the trained model."""

import torch

from brought_configs import FP16_AUTO
from helpers import FAST, launch


def test_torchrun_matches_deepspeed_launcher(trained, tmp_path):
    """Against the one shared baseline the deepspeed launcher runs (conftest.baseline_launcher)."""
    ref = trained("zero3", "fp32").check()
    assert ref.proc.args[0] == "deepspeed"
    run = launch(FAST + ["--deepspeed", "ds_configs/zero3.json"], tmp_path / "run", launcher="torchrun").check()
    assert max(abs(a - b) for a, b in zip(run.losses, ref.losses)) <= 1e-6
    assert len(run.losses) == len(ref.losses) == 8


def test_zero3_export_holds_the_gathered_trained_weights(trained):
    """Not empty ZeRO-3 placeholders: every tensor equals DeepSpeed's own consolidation of the checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained("zero3", "fp32").check()
    model = AutoModelForCausalLM.from_pretrained(run.output_dir)
    tok = AutoTokenizer.from_pretrained(run.output_dir)
    assert len(tok) == model.config.vocab_size
    # generate() stops where the tokenizer ends text (the Llama default eos id 2 is '"' in this tokenizer)
    assert model.generation_config.eos_token_id == model.config.eos_token_id == tok.eos_token_id
    ref = get_fp32_state_dict_from_zero_checkpoint(str(run.output_dir / "checkpoints"))
    exported = model.state_dict()
    assert set(ref) <= set(exported)
    for name, tensor in ref.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor.to(exported[name].dtype)), name
    # and it is a trained model, not the initialisation: it predicts the corpus better than chance
    ids = tok("Return the number of items in the container.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < torch.log(torch.tensor(float(model.config.vocab_size))).item() - 0.5


def test_pretrained_weights_load_straight_into_zero3_partitions(trained, tmp_path):
    pretrained = trained("zero3", "fp32").check().output_dir  # an exported model is a pretrained model
    args = FAST + ["--max_steps", "2", "--model_name_or_path", str(pretrained)]
    z3 = launch(args + ["--deepspeed", "ds_configs/zero3.json"], tmp_path / "z3", launcher="forked").check()
    z0 = launch(args + ["--deepspeed", "ds_configs/zero0.json"], tmp_path / "z0", launcher="forked").check()
    held, total = (int(x) for x in z3.log.split("rank 0 holds ")[1].split(" parameters")[0].split(" of "))
    assert held <= total // 2 + 1000  # rank 0 never held the full model, only its partition
    assert abs(z3.losses[0] - z0.losses[0]) < 1e-5
    from_scratch = trained("zero0", "fp32").losses[0]
    assert z3.losses[0] < from_scratch - 0.5  # the trained weights arrived, not a fresh init


def test_a_fine_tune_whose_loss_climbs_is_warned_once(trained, tmp_path):
    """The early warning end to end (its rule: tests/unit/training/test_loss_rise.py): a pretrained model fine-tuned at a
    learning rate far above the fine-tuning default. The healthy fine-tunes of the shipped recipes stay silent
    (test_sft_training.py)."""
    pretrained = trained("zero3", "fp32").check().output_dir
    args = FAST + ["--max_steps", "5", "--model_name_or_path", str(pretrained), "--learning_rate", "0.1"]
    run = launch(args + ["--deepspeed", "ds_configs/zero2.json"], tmp_path / "hot", launcher="forked").check()
    warnings = [line for line in run.log.splitlines() if "warning: the loss rose" in line]
    assert len(warnings) == 1, run.log[-3000:]
    assert "full fine-tuning of a pretrained checkpoint: learning_rate 0.1 may be too high" in warnings[0]
    assert "its default is 2e-05" in warnings[0]


def test_other_architecture_from_inline_model_config(tmp_path):
    gpt2 = '{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}'
    run = launch(
        FAST + ["--model_config", gpt2, "--deepspeed", "ds_configs/zero3.json"], tmp_path / "gpt2", launcher="forked"
    ).check()
    assert run.losses[-1] < run.losses[0] - 0.5
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.output_dir)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_layer == 2


def test_plain_python_is_a_world_of_one(tmp_path):
    run = launch(
        FAST + ["--max_steps", "3", "--deepspeed", "ds_configs/zero2.json"], tmp_path / "one", launcher="python"
    ).check()
    assert "distributed: 1 rank = 1 data-parallel" in run.log and len(run.losses) == 3
    assert (run.output_dir / "model.safetensors").exists()


HF_TRAINER_ZERO2 = {
    # The shape of the HF Trainer docs' ZeRO-2 example, unchanged: DeepSpeed builds optimizer and scheduler.
    "fp16": FP16_AUTO,
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "none"},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_hf_trainer_config_works_unchanged(tmp_path):
    import json

    path = tmp_path / "hf_zero2.json"
    path.write_text(json.dumps(HF_TRAINER_ZERO2))
    run = launch(
        FAST + ["--deepspeed", str(path), "--gradient_accumulation_steps", "2"], tmp_path / "hf", launcher="forked"
    ).check()
    resolved = json.loads((run.output_dir / "ds_config.json").read_text())
    assert resolved["train_batch_size"] == 4 * 2 * 2
    assert resolved["optimizer"]["params"]["lr"] == 3e-3
    assert resolved["scheduler"]["params"]["total_num_steps"] == 8
    assert resolved["scheduler"]["params"]["warmup_num_steps"] == 1
    assert run.losses[-1] < run.losses[0] - 0.5
    lrs = [r["lr"] for r in run.records if "loss" in r]
    # DeepSpeed's own WarmupDecayLR ran with our numbers: it peaks at learning_rate and decays to ~0 by step 8
    assert max(lrs) == 3e-3 and lrs[-1] <= 3e-3 / 4 and lrs == lrs[:2] + sorted(lrs[2:], reverse=True)
