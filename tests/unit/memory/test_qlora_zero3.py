"""QLoRA under ZeRO-3 as other stacks run it (bnb_4bit_quant_storage in the 16-bit dtype, so ZeRO-3 shards the
packed NF4 codes; train.py refuses the pair): the frozen linears are partitioned at NF4's bytes, not 16 bits."""

from transformers import AutoConfig

from zero_recipes.memory import Launch, estimate
from zero_recipes.memory.states import NF4_BYTES

LLAMA2_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=4, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip


def states_at_step(load_in_4bit: bool) -> int:
    from peft import LoraConfig

    from zero_recipes.config.cli import parse_args
    from zero_recipes.ds import intake

    files = ["ds_configs/zero3.json", "ds_configs/bf16.json"]
    cfg, explicit = parse_args(["--deepspeed", *files, "--per_device_train_batch_size", "1"])
    ds = intake.with_steps(intake.resolve(intake.load_fragments(files), cfg, explicit, 2, 8192).ds, cfg, 1000)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    config = AutoConfig.for_model("llama", **LLAMA2_70B)
    e = estimate(config, ds, Launch(2, 1, 1, 512, True, tiled_loss=False), lora=lora, load_in_4bit=load_in_4bit)
    return e.phases["optimizer_step"]["model_states_bytes"]


def test_zero3_partitions_the_nf4_codes():
    """Each of 2 ranks holds half the frozen linears (every linear but the head: q, k, v, o, gate, up and down of
    every layer; 4 of its 80 layers here) at NF4's bytes instead of bf16's 2."""
    c = LLAMA2_70B
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    linears = c["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"])
    saved = states_at_step(False) - states_at_step(True)
    assert abs(saved - (2 - NF4_BYTES) * linears / 2) < 64
