"""Every recipe of the catalogue trains, for real, through train.py on this CPU.

Each run is `train.py --recipe recipes/X.yaml` for 2 steps with only these stand-ins, because nothing can be
downloaded here: the model is a tiny one of the recipe's model_type, made from the published config the recipe
ships in recipes/configs/ (pretrained weights in a local directory for SFT recipes, a --model_config for the
from-scratch ones), with the embedded tokenizer; the hub dataset is a tiny local directory laid out like the
hub repo (same config name, split names, columns and format). Block size, logging and the eval cap are shrunk.
Everything else stays as shipped: the DeepSpeed fragments (ZeRO stage, offload, bf16), gradient
checkpointing, packing, streaming, micro-batch, accumulation, optimizer and schedule.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from helpers import REPO

# recipe -> the data it trains on, ranks and launcher for this test, and what its resolved DeepSpeed
# config must say. ZeRO-3 runs on 2 ranks once (the multi-node recipe, through the deepspeed launcher).
CATALOGUE = {
    "gpt2-wikitext103.yaml": dict(data="wikitext", nproc=1, stage=1, offload=(None, None)),
    "smollm2-135m-pretrain.yaml": dict(data="fineweb-edu", nproc=1, stage=2, offload=(None, None)),
    "llama-3.2-1b-sft.yaml": dict(data="ultrachat", nproc=1, stage=2, offload=(None, None)),
    "llama-3.2-3b-sft.yaml": dict(data="ultrachat", nproc=1, stage=2, offload=(None, None)),
    "qwen2.5-7b-sft-zero3.yaml": dict(data="smoltalk", nproc=1, stage=3, offload=(None, None)),
    "mistral-7b-sft.yaml": dict(data="alpaca", nproc=1, stage=2, offload=(None, None)),
    "llama-3.1-8b-sft-offload-24gb.yaml": dict(data="ultrachat", nproc=1, stage=3, offload=("cpu", "cpu")),
    "llama-3.1-70b-sft-multinode.yaml": dict(data="ultrachat", nproc=2, stage=3, offload=(None, None)),
}
# the quick start's recipes: tiny-sft is trained by test_sft_training.py; tiny-llama is the embedded default
# (identical to `train.py --deepspeed ds_configs/zero3.json`), which the training tests run throughout
ELSEWHERE = {"tiny-llama.yaml", "tiny-sft.yaml"}

# Tiny shapes per architecture: 2 layers, width 64, GQA kept (4 heads over 2 KV heads).
TINY = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
TINY["qwen2"] = TINY["mistral"] = TINY["llama"]
BLOCK = {"text": 64, "sft": 128}


def recipe_of(name: str) -> dict:
    return yaml.safe_load((REPO / "recipes" / name).read_text())


def shipped_config(name: str) -> Path:
    """The published config.json of the recipe's architecture: its model_config (from-scratch recipes), or
    the one its '# Memory:' command names (recipes that load a hub model)."""
    recipe = recipe_of(name)
    if recipe.get("model_config"):
        return REPO / recipe["model_config"]
    m = re.search(r"--model (recipes/configs/\S+\.json)", (REPO / "recipes" / name).read_text())
    assert m, f"{name}: names no config in recipes/configs/"
    return REPO / m.group(1)


def test_every_recipe_is_in_the_catalogue_test():
    shipped = {p.name for p in (REPO / "recipes").glob("*.yaml")} - ELSEWHERE
    assert shipped == set(CATALOGUE), "add the recipe to CATALOGUE (or remove it from the table)"
