"""tools/estimate_memory.py's settings for a run from another stack (zero_recipes/memory/stack.py), through the
tool as a user runs it: each moves the figure it should, by what the stack's code allocates, or is refused in
one line."""

import json

import pytest

from helpers import tool_in_process

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192, "tie_word_embeddings": True}  # fmt: skip


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("stack") / "config.json"
    path.write_text(json.dumps(LLAMA_1B))
    return path


def estimate(config_json, *extra, stage=2):
    done = tool_in_process("estimate_memory", "--model", config_json, "--deepspeed", f"ds_configs/zero{stage}.json",
                           "ds_configs/bf16.json", "--num_gpus", "4", "--seq_len", "2048", "--json", *extra)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_8bit_adam_keeps_a_quarter_of_the_moments(config_json):
    """bitsandbytes' moments are 1 byte each against AdamW's fp32 4: the optimizer state drops to a quarter, the
    master weights stay, and the peak falls by the difference."""
    adamw, eight = estimate(config_json), estimate(config_json, "--optim", "adamw_8bit")
    assert eight["optimizer_states"]["optimizer_bytes"] * 4 == pytest.approx(
        adamw["optimizer_states"]["optimizer_bytes"], abs=4
    )
    assert eight["optimizer_states"]["master_bytes"] == adamw["optimizer_states"]["master_bytes"]
    saved = adamw["optimizer_states"]["optimizer_bytes"] - eight["optimizer_states"]["optimizer_bytes"]
    assert adamw["per_gpu"]["peak_bytes"] - eight["per_gpu"]["peak_bytes"] == pytest.approx(saved, rel=1e-6)
    assert any("adamw_8bit" in n for n in eight["notes"])


def test_unfused_adamw_costs_its_foreach_temporaries_in_the_step(tmp_path):
    """torch's foreach AdamW allocates 4 B an element of the rank's partition in its step, where fused allocates
    none. ZeRO-2's step (zero/stage_1_and_2.py `step`) runs three transients one after another: the grad norm's fp64
    copy of the largest param's piece (8 B x 525M / 8.03B = 0.52 B/param here), the flat 16-bit grad partition with
    its fp32 copy (6 B/N), then that fp32 copy beside the optimizer's temporaries (4 + 4 B/N unfused, 4 B/N fused).
    Fused, the flat copy sets the step (6/N); unfused, the temporaries (8/N): the step grows by 2 B/N a parameter.
    Llama-3-8B's shape on 4 GPUs."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_1B | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                           "tie_word_embeddings": False}))  # fmt: skip
    fused, unfused = estimate(path), estimate(path, "--optim", "adamw_torch")
    step = lambda e: e["phases"]["optimizer_step"]["device_bytes"]  # noqa: E731
    params, largest = fused["num_params"], 128256 * 4096
    assert 8 * largest / params < 6 / 4  # the norm's copy is not the step's largest transient here
    assert step(unfused) - step(fused) == pytest.approx((8 - 6) * params / 4, abs=64)


def test_eager_attention_costs_its_score_matrices(config_json):
    sdpa, eager = estimate(config_json), estimate(config_json, "--attn_implementation", "eager")
    assert eager["per_gpu"]["activations_bytes"] > sdpa["per_gpu"]["activations_bytes"] + 2 * 32 * 2048**2


def test_liger_tiles_the_loss_at_its_chunk(config_json):
    """Liger's chunk for 2048 tokens of a 128256 x 2048 head: ceil(2048 / ceil(128256 / 2048)) = 33 rows, rounded
    up to a power of two: 64. Estimated as train.py's tiled loss at 64-token tiles, below the whole logits, and with
    Liger's SwiGLU and RMSNorm saving less still (tests/unit/memory/test_liger.py)."""
    gc = "--gradient_checkpointing"
    whole = estimate(config_json, "--tiled_loss", "false", gc)
    liger = estimate(config_json, "--liger", "true", gc)
    tiles = estimate(config_json, "--loss_tile_tokens", "64", gc)
    act = lambda e: e["phases"]["forward_backward"]["activations_bytes"]  # noqa: E731
    assert act(liger) < act(tiles) < act(whole)
    assert any("tiles of 64 tokens" in n for n in liger["notes"]) and any("Liger" in n for n in liger["notes"])


def test_rope_scaling_lifts_the_length_limit_and_nothing_else(config_json):
    at_limit = estimate(config_json, "--seq_len", "8192")
    scaled = estimate(config_json, "--seq_len", "8192", "--rope_scaling", "4")
    assert scaled["per_gpu"]["peak_bytes"] == at_limit["per_gpu"]["peak_bytes"]
    assert estimate(config_json, "--seq_len", "32768", "--rope_scaling", "4")["per_gpu"]["peak_bytes"] > 0


def test_a_model_built_before_deepspeed_is_moved_whole_to_each_gpu_under_zero3(config_json):
    built = estimate(config_json, stage=3)
    pre = estimate(config_json, "--zero_init", "false", "--deepspeed_version", "0.14.2", stage=3)
    params = built["num_params"]
    assert pre["phases"]["init"]["device_bytes"] >= 2 * params  # above the init of a model built in partitions
    assert pre["phases"]["forward_backward"]["device_bytes"] > built["phases"]["forward_backward"]["device_bytes"]
    assert pre["per_node"]["cpu_bytes"] == 4 * 4 * params  # 4 processes, each loads it in fp32


@pytest.mark.parametrize(
    "extra,said",
    [
        (["--seq_len", "16384"], "--rope_scaling 2 if the run extends the context"),
        (["--seq_len", "65536", "--rope_scaling", "4"], "past max_position_embeddings 8192 x --rope_scaling 4"),
        (["--rope_scaling", "0.5"], "above 1"),
        (["--deepspeed_version", "0.14.2"], "add --zero_init false"),
        (["--zero_init", "false", "--deepspeed_version", "new"], "write it like 0.14.2"),
        (["--liger", "true", "--tiled_loss", "false"], "drop --tiled_loss false"),
    ],
)
def test_refused_in_one_line(config_json, extra, said):
    done = tool_in_process("estimate_memory", "--model", config_json, "--deepspeed", "ds_configs/zero2.json", *extra)
    assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
