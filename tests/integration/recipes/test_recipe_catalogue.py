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

import functools
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from helpers import REPO, launch
from zero_recipes.config.shipped import (
    ARCHITECTURES,
    EXPERT_PARALLEL,
    PIPELINE_PARALLEL,
    SEQUENCE_PARALLEL,
    TENSOR_PARALLEL,
)

# recipe -> the data it trains on, ranks and launcher for this test, and what its resolved DeepSpeed
# config must say. ZeRO-3 runs on 2 ranks once (the multi-node recipe, through the deepspeed launcher); every
# other recipe, on 1 rank or 2, is forked under torchrun's agent, since its subject is the recipe
# (docs/dev/test-suite.md#launchers): a 1-rank recipe as `python train.py` took 7-21 s a launch here, most of it
# importing torch, transformers and DeepSpeed again, which a forked rank starts past.
CATALOGUE = {
    "gpt2-wikitext103.yaml": dict(data="wikitext", nproc=1, stage=1, offload=(None, None)),
    "smollm2-135m-pretrain.yaml": dict(data="fineweb-edu", nproc=1, stage=2, offload=(None, None)),
    "smollm2-135m-pretrain-muon.yaml": dict(data="fineweb-edu", nproc=1, stage=2, offload=(None, None)),
    "llama-3.2-1b-pretrain-news-clean.yaml": dict(data="c4-news", nproc=1, stage=2, offload=(None, None)),
    "llama-3.2-1b-sft.yaml": dict(data="ultrachat", nproc=1, stage=2, offload=(None, None)),
    "llama-3.2-3b-sft.yaml": dict(data="ultrachat", nproc=1, stage=2, offload=(None, None)),
    "qwen2.5-7b-sft-zero3.yaml": dict(data="smoltalk", nproc=1, stage=3, offload=(None, None)),
    "mistral-7b-sft.yaml": dict(data="alpaca", nproc=1, stage=2, offload=(None, None)),
    "llama-3.1-8b-sft-offload-24gb.yaml": dict(data="ultrachat", nproc=1, stage=3, offload=("cpu", "cpu")),
    "llama-3.1-70b-sft-multinode.yaml": dict(data="ultrachat", nproc=2, stage=3, offload=(None, None)),
    "llama-3.1-8b-lora-24gb.yaml": dict(data="ultrachat", nproc=1, stage=2, offload=(None, None)),
    "qwen2.5-7b-lora-zero3.yaml": dict(data="smoltalk", nproc=2, stage=3, offload=(None, None)),
    # preference recipes (--objective dpo): a text prompt with chosen / rejected conversations, as H4's set
    "llama-3.1-8b-dpo.yaml": dict(data="ultrafeedback", nproc=1, stage=3, offload=(None, None)),
    "qwen2.5-7b-lora-dpo-24gb.yaml": dict(data="ultrafeedback", nproc=1, stage=2, offload=(None, None)),
    # tensor-parallel recipes: their TP8 stood in for by TP2 on the 2 ranks (the tiny model has 2 KV heads)
    "llama-3.1-8b-sft-tp8.yaml": dict(data="ultrachat", nproc=2, stage=1, offload=(None, None), tp=2),
    "llama-3.1-70b-sft-tp8-4nodes.yaml": dict(data="ultrachat", nproc=2, stage=1, offload=(None, None), tp=2),
    # pipeline recipes: their 4 or 8 stages stood in for by 2 on the 2 ranks (the tiny model has 2 layers)
    "llama-3.2-3b-sft-pp4-24gb.yaml": dict(data="ultrachat", nproc=2, stage=0, offload=(None, None), pp=2),
    "llama-3.1-70b-sft-pp8-4nodes.yaml": dict(data="ultrachat", nproc=2, stage=1, offload=(None, None), pp=2),
    # long context: its SP8 stood in for by SP2 on the 2 ranks, its 64k rows by the SFT block below
    "llama-3.1-8b-sft-longctx-sp8.yaml": dict(data="longalign", nproc=2, stage=3, offload=(None, None), sp=2),
    # a mixture of experts: its EP4 stood in for by EP2 on the 2 ranks
    "qwen3-30b-a3b-sft-8x80gb.yaml": dict(data="smoltalk", nproc=2, stage=2, offload=(None, None), ep=2),
}
# the quick start's recipes: tiny-sft and tiny-lora-sft are trained by test_sft_training.py; tiny-llama is the embedded default
# (identical to `train.py --deepspeed ds_configs/zero3.json`), which the training tests run throughout
ELSEWHERE = {
    "tiny-llama.yaml",
    "tiny-sft.yaml",
    "tiny-lora-sft.yaml",
    "tiny-longctx-sp2.yaml",
    "tiny-moe.yaml",
    "tiny-dpo.yaml",
}  # fmt: skip -- tiny-dpo: tests/integration/preference/test_dpo.py trains it

# Tiny shapes per architecture: 2 layers, width 64, GQA kept (4 heads over 2 KV heads).
TINY = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
TINY["qwen2"] = TINY["mistral"] = TINY["llama"]
TINY["qwen3_moe"] = dict(TINY["llama"], moe_intermediate_size=32)  # its 128 experts, 8 per token, as published
BLOCK = {"text": 64, "sft": 128}
# Rows of each stand-in's train split. 400 feed every recipe's 2 steps (the most: 64 packed 128-token rows) and plant
# c4-news's 16 garbled articles. A preference run computes its reference log-probs over the whole split before its
# first step, so ultrafeedback has only what the DPO recipes' 2 steps take (16 pairs a step) and a margin: with 400
# pairs, the 1-rank LoRA DPO recipe's reference pass took 6 s on a quiet 2-core host and 32-44 s on a busy one.
TRAIN_ROWS = {"ultrafeedback": 48}


def recipe_of(name: str) -> dict:
    return yaml.safe_load((REPO / "recipes" / name).read_text())


def shipped_config(name: str) -> Path:
    """The published config.json of the recipe's architecture: its model_config (from-scratch recipes), or
    the hub model's, shipped in recipes/configs/ (shipped.ARCHITECTURES; its '# Memory:' command names the same)."""
    recipe = recipe_of(name)
    if recipe.get("model_config"):
        return REPO / recipe["model_config"]
    return REPO / ARCHITECTURES[recipe["model_name_or_path"]]


# ---- stand-ins -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(shared_cache):
    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import builtin_tokenizer_dir

    return builtin_tokenizer_dir(TrainConfig())


def tiny_config(name: str, tokenizer):
    """The recipe's published config with the size fields shrunk; everything else (rope scaling, tied
    embeddings, dropout, norms, activations) as published."""
    from transformers import AutoConfig

    fields = json.loads(shipped_config(name).read_text())
    model_type = fields.pop("model_type")
    fields.update(
        TINY[model_type],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if "head_dim" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return AutoConfig.for_model(model_type, **fields)


def tiny_model(name: str, tokenizer_dir: Path, out: Path) -> list[str]:
    """The train.py flags that stand in for the recipe's model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config(name, tokenizer)
    if recipe_of(name).get("model_name_or_path"):  # fine-tuning: a pretrained model directory, as on the hub
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
        return ["--model_name_or_path", str(out)]
    out.mkdir()  # from scratch: an architecture (model_config with model_type) and a tokenizer
    config.to_json_file(out / "config.json")
    return ["--model_config", str(out / "config.json"), "--tokenizer_name_or_path", str(tokenizer_dir)]


WORDS = (
    "the model reads a file and returns a list of the values it found in each line while the "
    "parser keeps the order of keys so that a second call gives the same result for every input"
).split()


def sentence(i: int, n: int = 12) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n)).capitalize() + "."


def chat(i: int, system: bool = False) -> list[dict]:
    turns = [{"role": "system", "content": "You are a helpful assistant."}] if system else []
    for t in range(1 + i % 2):  # one or two exchanges
        turns += [
            {"role": "user", "content": f"Question {i}.{t}: {sentence(i + t, 6)}"},
            {"role": "assistant", "content": sentence(i + t + 1, 8)},
        ]
    return turns


@functools.lru_cache(1)
def long_docstrings() -> list[str]:
    from zero_recipes.data.builtin import stdlib_docstrings

    return [d for d in stdlib_docstrings() if len(d.split()) >= 60]


def news_article(i: int) -> str:
    """c4 realnewslike's stand-in: articles of real English prose (the embedded corpus's docstrings), every
    tenth a copy of the one before it under another header (a near-duplicate, which the recipe's cleaning
    removes) and every 25th garbled (dropped)."""
    docs = long_docstrings()
    if i % 25 == 24:
        return "\ufffd\ufffd " * 200
    if i % 10 == 9:
        return "Syndicated by Example Wire\n\n" + docs[(i - 1) % len(docs)]
    return docs[i % len(docs)]


def rows(kind: str, n: int, start: int = 0) -> list[dict]:
    """Rows with the columns of the real dataset."""
    out = []
    for i in range(start, start + n):
        if kind == "wikitext":  # one line per row: headings, paragraphs and the empty lines between them
            out.append({"text": [" = Section {} = \n".format(i), "", " " + sentence(i, 40) + " \n"][i % 3]})
        elif kind == "fineweb-edu":
            out.append(
                {
                    "text": " ".join(sentence(i + k) for k in range(8)),
                    "id": f"<urn:uuid:{i:08d}>",
                    "dump": "CC-MAIN-2024-10",
                    "url": f"https://example.org/{i}",
                    "language": "en",
                    "score": 3.1,
                    "int_score": 3,
                }
            )
        elif kind == "c4-news":
            out.append(
                {"text": news_article(i), "timestamp": "2019-04-25T10:40:43Z", "url": f"https://example.org/{i}"}
            )
        elif kind in ("ultrachat", "longalign"):
            messages = chat(i)
            if kind == "ultrachat":
                out.append({"prompt": messages[0]["content"], "prompt_id": f"{i:064x}", "messages": messages})
            else:
                out.append({"messages": messages})
        elif kind == "ultrafeedback":  # HuggingFaceH4/ultrafeedback_binarized's *_prefs splits
            question = {"role": "user", "content": f"Question {i}: {sentence(i, 6)}"}
            chosen = [question, {"role": "assistant", "content": sentence(i + 1, 8)}]
            rejected = [question, {"role": "assistant", "content": sentence(i + 2, 5)}]
            out.append({"prompt": question["content"], "prompt_id": f"{i:064x}", "chosen": chosen,
                        "rejected": rejected, "messages": chosen, "score_chosen": 8.0, "score_rejected": 4.0})  # fmt: skip
        elif kind == "smoltalk":
            out.append({"messages": chat(i, system=i % 3 == 0), "source": "smol-magpie-ultra"})
        elif kind == "alpaca":
            out.append(
                {
                    "instruction": sentence(i, 6),
                    "input": "" if i % 2 else sentence(i + 1, 5),
                    "output": sentence(i + 2, 8),
                }
            )
    return out


def tiny_dataset(name: str, parent: Path) -> list[str]:
    """A local directory laid out like the recipe's hub dataset: its config name and split names in the
    README's `configs`, the same columns, so the recipe's dataset options stay as shipped. The directory is named
    after its contents: `datasets` caches a local directory's splits under its name and config, not its files
    (~/.cache/huggingface/datasets/data/default/...), so a directory of one name would be read back from an
    earlier run's rows whatever this run wrote."""
    import hashlib

    import datasets

    recipe, kind = recipe_of(name), CATALOGUE[name]["data"]
    config = recipe.get("dataset_config_name") or "default"
    if kind in ("alpaca", "longalign"):  # one file at the repo root, a single train split
        splits = {"train": rows(kind, 400)}
    else:
        splits = {recipe.get("dataset_split", "train"): rows(kind, TRAIN_ROWS.get(kind, 400))}
        if recipe.get("eval_split"):
            splits[recipe["eval_split"]] = rows(kind, 40, start=10_000)
    digest = hashlib.sha256(json.dumps([kind, config, splits], sort_keys=True).encode()).hexdigest()[:12]
    out = parent / f"{kind}-{digest}"
    out.mkdir(parents=True)
    if kind == "alpaca":  # yahma/alpaca-cleaned: one JSON array at the repo root
        (out / "alpaca_data_cleaned.json").write_text(json.dumps(splits["train"]))
        return ["--dataset_name", str(out)]
    if kind == "longalign":  # THUDM/LongAlign-10k: one JSON-lines file at the repo root
        (out / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in splits["train"]))
        return ["--dataset_name", str(out)]
    files = []
    for split, data in splits.items():
        path = f"{config}/{split}-00000-of-00001.parquet"
        (out / config).mkdir(exist_ok=True)
        datasets.Dataset.from_list(data).to_parquet(out / path)
        files.append(f"  - split: {split}\n    path: {path}\n")
    (out / "README.md").write_text(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{''.join(files)}---\n")
    return ["--dataset_name", str(out)]


# ---- the runs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_recipe_trains_two_steps_on_cpu(name, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    spec, recipe = CATALOGUE[name], recipe_of(name)
    text = recipe.get("dataset_format") == "text"
    args = [
        "--recipe",
        f"recipes/{name}",
        *tiny_model(name, tokenizer_dir, tmp_path / "model"),
        *tiny_dataset(name, tmp_path / "data"),
        "--max_steps",
        "2",
        "--block_size",
        str(BLOCK["text" if text else "sft"]),
        "--logging_steps",
        "1",
        "--max_eval_batches",
        "2",
    ]
    tp, sp, pp, ep = spec.get("tp", 1), spec.get("sp", 1), spec.get("pp", 1), spec.get("ep", 1)
    if tp > 1 or sp > 1 or pp > 1 or ep > 1:  # the recipe's own fragments, its TP/SP/PP/EP degree shrunk to the ranks
        shrunk = {"/tp": TENSOR_PARALLEL.get(tp), "/sp": SEQUENCE_PARALLEL.get(sp), "/pp": PIPELINE_PARALLEL.get(pp)}
        shrunk["/ep"] = EXPERT_PARALLEL.get(ep)
        fragments = [next((small for key, small in shrunk.items() if key in f), f) for f in recipe["deepspeed"]]
        assert fragments != recipe["deepspeed"], f"{name}: no tpN.json, spN.json, ppN.json or epN.json to shrink"
        args += ["--deepspeed", *fragments]
    launcher = "deepspeed" if "multinode" in name else "forked"
    run = launch(args, tmp_path / "run", nproc=spec["nproc"], launcher=launcher).check()
    if tp > 1:
        dp = spec["nproc"] // tp
        assert f"distributed: {spec['nproc']} ranks = {dp} data-parallel x {tp} tensor-parallel" in run.log
    if sp > 1:
        dp = spec["nproc"] // sp
        assert f"distributed: {spec['nproc']} ranks = {dp} data-parallel x {sp} sequence-parallel" in run.log
    if pp > 1:
        dp = spec["nproc"] // pp
        assert f"distributed: {spec['nproc']} ranks = {dp} data-parallel x {pp} pipeline-parallel" in run.log

    if spec["data"] == "c4-news":  # the stand-in's planted near-duplicates and garbled articles are gone
        removed = dict(
            re.findall(r"(near duplicates \(similarity >= 0\.7\)|garbled: [a-z -]+): -(\d+) documents", run.log)
        )
        assert (
            int(removed["near duplicates (similarity >= 0.7)"]) >= 32
            and int(removed["garbled: replacement characters"]) == 16
        ), removed

    losses = run.losses
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), run.log[-3000:]
    evals = [r for r in run.records if "eval_loss" in r]
    assert evals and math.isfinite(evals[-1]["eval_loss"]), run.log[-3000:]

    # the DeepSpeed config as resolved for the run: the recipe's stage, offload and precision
    ds = json.loads((run.output_dir / "ds_config.json").read_text())
    zero = ds["zero_optimization"]
    assert zero["stage"] == spec["stage"]
    assert tuple((zero.get(k) or {}).get("device") for k in ("offload_optimizer", "offload_param")) == spec["offload"]
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["train_micro_batch_size_per_gpu"] == recipe["per_device_train_batch_size"]
    assert ds["gradient_accumulation_steps"] == recipe["gradient_accumulation_steps"]
    assert ds["train_batch_size"] == (  # a tensor- or sequence-parallel group shares its micro-batch
        recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"] * spec["nproc"] // (tp * sp * pp)
    )
    assert ds.get("tensor_parallel", {}).get("autotp_size", 1) == tp
    assert ds.get("sequence_parallel_size", 1) == sp
    assert ds.get("pipeline", {}).get("stages", 1) == pp
    assert ds.get("expert_parallel", {}).get("autoep_size", 1) == ep
    if ep > 1:
        assert f"experts split {ep} ways" in run.log
    # and the rest of the run as shipped
    run_config = json.loads((run.output_dir / "run_config.json").read_text())
    for key in (
        "gradient_checkpointing",
        "packing",
        "streaming",
        "dataset_format",
        "dataset_config_name",
        "dataset_split",
        "eval_split",
        "learning_rate",
        "lr_scheduler_type",
        "attn_implementation",
        *("fix_text", "drop_garbled", "quality_filter", "dedupe", "dedupe_threshold"),
    ):
        if key in recipe:
            assert run_config[key] == recipe[key], key

    # the output is a Hugging Face model of the recipe's architecture, or a PEFT adapter on one
    if recipe.get("lora"):
        from zero_recipes.adapters.lora import load_for_inference

        assert run_config["lora_r"] == recipe["lora"]["r"] and "lora: r" in run.log
        model = load_for_inference(run.output_dir, dtype=None).get_base_model()
    else:
        model = AutoModelForCausalLM.from_pretrained(run.output_dir)
    assert model.config.model_type == json.loads(shipped_config(name).read_text())["model_type"]


def test_every_recipe_is_in_the_catalogue_test():
    shipped = {p.name for p in (REPO / "recipes").glob("*.yaml")} - ELSEWHERE
    assert shipped == set(CATALOGUE), "add the recipe to CATALOGUE (or remove it from the table)"


def test_tiny_long_context_recipe_trains_two_steps_on_two_ranks(tmp_path):
    """As shipped (ZeRO-3, SP2, gradient checkpointing, tiled loss) but with 1024-token rows and 2 steps."""
    args = ["--recipe", "recipes/tiny-longctx-sp2.yaml", "--max_steps", "2", "--block_size", "1024"]
    args += ["--logging_steps", "1", "--max_eval_batches", "1", "--save_steps", "2", "--eval_steps", "2"]
    run = launch(args, tmp_path / "run", nproc=2, launcher="forked").check()  # the recipe is the subject
    assert "distributed: 2 ranks = 1 data-parallel x 2 sequence-parallel" in run.log
    assert "each rank trains 512 of every 1024 tokens" in run.log
    assert len(run.losses) == 2 and all(math.isfinite(x) for x in run.losses)
    assert [r for r in run.records if "eval_loss" in r]


def test_tiny_moe_recipe_trains_two_steps_on_two_ranks(tmp_path):
    """As shipped (the inline Mixtral, 8 experts top-2, ZeRO-2, the embedded corpus) but for 2 steps."""
    args = ["--recipe", "recipes/tiny-moe.yaml", "--max_steps", "2", "--logging_steps", "1", "--max_eval_batches", "1"]
    run = launch(
        args + ["--save_steps", "2", "--eval_steps", "2"], tmp_path / "run", nproc=2, launcher="forked"
    ).check()
    assert "active per token (8 experts, 2 per token, 4 of 4 layers sparse)" in run.log
    assert len(run.losses) == 2 and all(math.isfinite(x) for x in run.losses)
    assert [r for r in run.records if "eval_loss" in r]
