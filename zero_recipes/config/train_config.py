"""The whole configuration of a run: one typed schema, filled by a YAML recipe and `--key value` flags.

Field names follow Hugging Face `TrainingArguments` wherever one exists, so HF users feel at home.
Precedence, lowest to highest: the schema defaults, `--recipe FILE.yaml`, then command-line flags
(read in cli.py, which also prints `--help` from the docstrings here).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from zero_recipes.config import lora_options, lr_defaults
from zero_recipes.errors import ConfigError
from zero_recipes.training import lr_schedule

REPO_ROOT = Path(__file__).resolve().parents[2]

BUILTIN_DATASET = "builtin:python-docstrings"
"""The embedded corpus: docstrings of the running Python's standard library, present on any machine."""
BUILTIN_INSTRUCTIONS = "builtin:tiny-instructions"
"""The embedded instruction set: generated chat examples with checkable answers (recipes/tiny-sft.yaml)."""

DATASET_FORMATS = ("auto", "text", "prompt_completion", "alpaca", "messages")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
OBJECTIVES = ("lm", "dpo")  # modes.OBJECTIVES' names  # the HF Trainer's `optim` names for torch's AdamW


@dataclass
class TrainConfig:
    # ---- model -------------------------------------------------------------------------------------
    model_name_or_path: Optional[str] = None
    """Hub id or local directory of a pretrained model, loaded with `from_pretrained`. Unset (and no
    `model_config`): the embedded tiny Llama, randomly initialised."""
    model_config: Any = None
    """Random init from HF config fields: a JSON/YAML file, an inline JSON object, or a mapping in a
    recipe. With `model_type` it stands alone; otherwise it overrides the config of `model_name_or_path`
    (or of the embedded tiny Llama), which is how tests shrink any architecture."""
    tokenizer_name_or_path: Optional[str] = None
    """Hub id or local directory. Unset: the tokenizer of `model_name_or_path`, else the embedded
    byte-level BPE trained offline on the embedded corpus."""
    trust_remote_code: bool = False
    """Allow model/tokenizer code from the hub. Off by default: it executes downloaded code."""
    attn_implementation: str = "sdpa"
    """`sdpa`, `flash_attention_2` or `eager`."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about 30 % more compute."""
    tiled_loss: bool = True
    """Compute the output head and the loss over tiles of the sequence (DeepSpeed's sequence_tiled_compute),
    so the logits of a whole micro-batch never exist at once; engages only when a micro-batch has more
    tokens than one tile. Equal to the untiled loss up to summation order (tested within 1e-6 in fp32)."""
    loss_tile_tokens: int = 0
    """Tokens per loss tile. 0: as many as keep one tile's fp32 logits under 256 MiB (512 at a 128k vocabulary)."""
    tiled_mlp: bool = False
    """Run each decoder layer's MLP in tiles of hidden_size tokens (DeepSpeed's TiledMLP), recomputed in
    backward: for long sequences, where the MLP's intermediate activations dominate; costs one more MLP forward."""
    router_aux_loss_coef: Optional[float] = None
    """A mixture of experts' balancing-loss coefficient. Unset: the model config's own (Mixtral 0.001, OLMoE
    0.01); 0: no balancing loss. train.py turns the loss on for training (transformers adds it only with
    `output_router_logits`, which every MoE config leaves off) and logs it as `aux_loss`."""
    torch_compile: bool = False
    """Compile the model with torch.compile through DeepSpeed's `engine.compile()` (inductor). The first step
    pays the compile (~30 s for the tiny model on 2 CPU cores, cached afterwards); losses match eager."""

    # ---- objective (preference optimisation in TRL's DPOConfig names; docs/preference.md) ------------
    objective: str = "lm"
    """`lm`: the next-token loss (pretraining, or SFT on the answer tokens the data marks). `dpo`: preference
    optimisation on prompt/chosen/rejected pairs; `per_device_train_batch_size` then counts pairs."""
    beta: float = 0.1
    """DPO's beta (the reference's pull); ORPO's lambda, as TRL's ORPOConfig names it."""
    loss_type: list = field(default_factory=lambda: ["sigmoid"])
    """TRL's loss types (sigmoid, ipo, hinge, robust, sft, ...; simpo and orpo need no reference); several are
    summed, weighted by `loss_weights`."""
    loss_weights: Optional[list] = None
    """One weight per `loss_type`. Unset: 1 each."""
    label_smoothing: float = 0.0
    """The share of flipped labels assumed by `robust` (cDPO), in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (TRL's CPOConfig name)."""
    cpo_alpha: float = 0.0
    """With `simpo`: the weight of the chosen answers' NLL (TRL's CPOConfig; 0: SimPO as its paper, 1: CPO-SimPO)."""
    max_length: Optional[int] = 1024
    """Tokens of prompt + answer per side at most (TRL's `max_length`, `keep_start`): longer answers are cut."""
    truncation_mode: str = "keep_start"
    """TRL's: `keep_start` only (the prompt is shared by both answers, so it is never cut)."""
    reference_cache: Optional[str] = None
    """Where the reference log-probs are kept. Unset: with the prepared pairs in the data cache."""

    # ---- LoRA (peft's names; a recipe may group them in a `lora:` block: r, alpha, dropout, ...) ------
    lora_r: int = 0
    """LoRA rank. 0: full fine-tuning. > 0: train low-rank adapters (peft) on a frozen pretrained base, which
    stays in 16 bits under bf16/fp16 with no gradients or optimizer state; output_dir becomes a PEFT
    adapter directory."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA path's input."""
    lora_target_modules: list = field(default_factory=lambda: ["all-linear"])
    """Module names (or name suffixes) that get adapters; `all-linear`: every linear layer but the output head."""
    modules_to_save: list = field(default_factory=list)
    """Modules trained in full and saved with the adapter, e.g. `lm_head embed_tokens` for a new vocabulary."""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base in 4 bits (bitsandbytes NF4, double quantisation; computed in the run's
    precision). Needs LoRA and bitsandbytes; ZeRO-0/1/2 only."""
    merge_lora: bool = False
    """At the end, write the base with the adapters merged in (a plain HF model) instead of an adapter."""

    # ---- data --------------------------------------------------------------------------------------
    dataset_name: str = BUILTIN_DATASET
    """Hub dataset id, a local json/jsonl/csv/parquet/txt file, a directory saved by `datasets`, or an
    embedded set: `builtin:python-docstrings` (text) or `builtin:tiny-instructions` (chat)."""
    dataset_config_name: Optional[str] = None
    """The hub dataset's configuration (its second argument to `load_dataset`)."""
    dataset_split: str = "train"
    """Split to train on."""
    eval_split: Optional[str] = None
    """Split to evaluate on (e.g. `validation`). Unset: hold out `validation_split_percentage` of the
    training split."""
    dataset_mixture: Any = None
    """Several datasets mixed by weight: a list of {name, weight, and optionally config, split, format,
    text_column}, in a recipe, an inline JSON list or a JSON/YAML file. Weights must add up to 1. Each
    weight is that dataset's share of the training samples; a small set is repeated to reach it."""
    dataset_format: str = "auto"
    """`text` (pretraining), `prompt_completion`, `alpaca` (instruction/input/output) or `messages` (chat).
    `auto` detects it from the columns and says what it found."""
    text_column: str = "text"
    """Column holding the raw text (`text` format)."""
    streaming: bool = False
    """Stream the dataset (`datasets` streaming) and tokenise on the fly instead of preparing it up front,
    for corpora too big for the disk cache. Needs `max_steps`; order is the file order, sharded by rank."""
    train_on_prompt: bool = False
    """SFT formats: also train on prompt/user/system tokens. Off: labels are -100 there."""
    packing: bool = True
    """SFT formats: pack several whole examples into each block; position ids restart per example and
    examples do not attend to each other. Off: one example per row, padded to the longest in the batch.
    (`text` always concatenates the whole stream.)"""
    block_size: int = 256
    """Tokens per training sequence. SFT examples longer than this are dropped, and counted in the log."""
    validation_split_percentage: float = 5.0
    """Percent of documents held out for eval loss (and SFT exact-match) when `eval_split` is unset."""
    fix_text: bool = False
    """Cleaning, first of all: repair mojibake (UTF-8 read as cp1252/latin-1), HTML entities, terminal escapes
    and broken line breaks with ftfy. Every string of an SFT example is repaired."""
    strip_html: bool = False
    """Cleaning (`text` format): remove HTML tags and decode entities."""
    normalize_whitespace: bool = False
    """Cleaning (`text` format): collapse runs of spaces/tabs and of blank lines, strip the ends."""
    drop_garbled: bool = False
    """Cleaning: drop documents (or SFT examples) of text no language produces: over 1 % replacement,
    control or private-use characters, under half letters and digits, or mojibake left after --fix_text."""
    quality_filter: str = "none"
    """Cleaning (`text` format): `gopher` drops documents that fail the Gopher quality and repetition rules
    (datatrove's), judged in characters for scripts written without spaces (Chinese, Japanese, Thai)."""
    min_document_tokens: int = 0
    """Cleaning: drop documents (or SFT examples) shorter than this many tokens; 1 drops empty ones."""
    dedupe: str = "none"
    """Cleaning: `exact` (or true) drops exact duplicates (by hash of the text, or of the whole SFT
    example); `near` drops near-duplicates by MinHash-LSH over 5-word shingles (5 characters for CJK).
    Needs the whole dataset, so not with --streaming: clean the files once with tools/clean_data.py."""
    dedupe_threshold: float = 0.7
    """`--dedupe near`: documents whose shingle sets' estimated Jaccard similarity is at least this are
    duplicates; of each group the first is kept."""
    preprocessing_num_workers: Optional[int] = None
    """Processes for tokenisation (`datasets.map(num_proc=...)`). Unset: one per core, at most 8. Small
    datasets get fewer (one per 2000 examples), since a process costs more than it saves there."""
    cache_dir: Optional[str] = None
    """Where the embedded data, tokenizer and prepared token arrays are cached. Unset:
    `$ZERO_RECIPES_CACHE` or `~/.cache/zero-recipes`."""

    # ---- optimisation (HF TrainingArguments names) -------------------------------------------------
    per_device_train_batch_size: int = 16
    """Micro-batch per rank (DeepSpeed `train_micro_batch_size_per_gpu`)."""
    per_device_eval_batch_size: int = 16
    gradient_accumulation_steps: int = 1
    learning_rate: float = lr_defaults.FROM_SCRATCH.learning_rate
    """Peak learning rate. Unset (in the recipe and flags): the value for what is trained, from scratch, full
    fine-tuning of a pretrained checkpoint or LoRA, which the launch names (docs/configuration.md)."""
    weight_decay: float = lr_defaults.FROM_SCRATCH.weight_decay
    """AdamW's decoupled weight decay. Unset: the value for what is trained, as for `learning_rate`."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch_fused"
    """`adamw_torch_fused` (one kernel per step, the HF Trainer's default) or `adamw_torch` (torch's per-tensor
    loop). Ignored when the DeepSpeed config has an `optimizer` block or offloads the optimizer."""
    max_grad_norm: float = 1.0
    """Gradient clipping (DeepSpeed `gradient_clipping`). 0 disables it."""
    num_train_epochs: float = 1.0
    """Used only when `max_steps` <= 0."""
    max_steps: int = 200
    """Optimizer steps to train. <= 0: derive from `num_train_epochs` and the dataset size."""
    warmup_steps: int = 0
    """Linear warmup steps; wins over `warmup_ratio` when > 0."""
    warmup_ratio: float = 0.05
    lr_scheduler_type: str = "cosine"
    """`cosine`, `linear` or `constant_with_warmup`, as `transformers.get_scheduler`."""
    seed: int = 42
    """One seed, one model: the initial weights are the same whatever the ZeRO stage or world size."""
    bf16: Optional[bool] = None
    """bf16 mixed precision. Unset: follow the DeepSpeed config; its "auto" then means off."""
    fp16: Optional[bool] = None
    """fp16 mixed precision with dynamic loss scaling. Unset: as for `bf16`."""
    tf32: Optional[bool] = None
    """TF32 matmuls and convolutions on Ampere and newer GPUs (the HF Trainer's `tf32`): fp32 runs go about 7x
    faster at 10-bit mantissa products. Unset: torch's default (off for matmuls). Refused without CUDA."""

    # ---- DeepSpeed ---------------------------------------------------------------------------------
    deepspeed: list = field(default_factory=list)
    """DeepSpeed JSON files, deep-merged left to right; "auto" values are filled as the HF Trainer does."""
    nvme_path: Optional[str] = None
    """Directory on a fast local NVMe for ZeRO-Infinity (fills "auto" `nvme_path` in `nvme.json`)."""

    # ---- logging, eval, checkpoints ----------------------------------------------------------------
    output_dir: str = "outputs/tiny-llama"
    """Run directory: metrics.jsonl, the resolved configs, checkpoints/ and, at the end, the HF model."""
    overwrite_output_dir: bool = False
    """Allow training into an `output_dir` that holds a different run."""
    logging_steps: int = 10
    report_to: list = field(default_factory=lambda: ["tensorboard"])
    """Where metrics go besides metrics.jsonl: `tensorboard` (output_dir/tensorboard), `wandb` (project from
    WANDB_PROJECT; WANDB_MODE=offline works without a network), both, or `none`."""
    run_name: Optional[str] = None
    """The run's name in W&B. Unset: the output_dir's name."""
    eval_steps: int = 50
    """Evaluate every N optimizer steps (and at the end). 0 disables periodic eval."""
    eval_on_start: bool = False
    """Evaluate once before the first step (a baseline for the curve), as HF's `eval_on_start`."""
    max_eval_batches: int = 50
    """Cap on eval micro-batches per rank, so eval stays cheap on big held-out sets. 0: no cap."""
    eval_tasks: list = field(default_factory=list)
    """lm-evaluation-harness tasks run on the live model at each evaluation: lm-eval's names, the shipped
    ones in eval_tasks/ (docstring_cloze, tiny_instructions) or YAML files. Values go to metrics.jsonl as
    eval_<task>_<metric>, with eval_tasks_seconds (docs/evaluation.md)."""
    eval_tasks_limit: float = 0
    """At most this many examples per task at each evaluation (a fraction if < 1). 0: all."""
    eval_samples: int = 0
    """Generate greedy answers to this many held-out prompts at each evaluation, added as a column per step
    to output_dir/eval_samples.html (and .jsonl). 0: none."""
    eval_samples_max_new_tokens: int = 48
    """Generated tokens at most per `eval_samples` answer."""
    save_steps: int = 100
    """Save a DeepSpeed checkpoint every N optimizer steps (and at the end). 0: only at the end."""
    save_total_limit: int = 2
    """Keep the newest N checkpoints. 0 keeps all. With N >= 2 the oldest goes before a save writes, so the disk
    never holds more than N."""
    resume_from_checkpoint: Optional[str] = None
    """`auto` (the newest in output_dir/checkpoints) or a checkpoint path."""
    verify_export: bool = False
    """After export, reload the HF model on rank 0 and check its logits equal the engine's."""
    dry_run: bool = False
    """Print the resolved DeepSpeed config and the plan, then exit without training."""

    ddp_timeout: int = 1800
    """Seconds a collective may wait before the run is aborted (the HF Trainer's `ddp_timeout`): what a dead
    peer costs before the survivors stop. Waits on work one rank does for all (preparing data, converting a
    universal checkpoint) are not bound by it."""

    # ---- accepted for launcher compatibility ------------------------------------------------------
    local_rank: int = -1
    """Set by the `deepspeed` launcher; the rank is read from the environment."""

    def __post_init__(self):
        # options that were bools once: normalised here so every reader sees one of their choices
        self.dedupe = choice("dedupe", self.dedupe, DEDUPE_MODES, on="exact")
        self.quality_filter = choice("quality_filter", self.quality_filter, QUALITY_FILTERS, on="gopher")


# Fields that steer this launch only; they do not make a different run (see run_dir.check_output_dir).
# output_dir is among them so that a run directory can be moved or copied and still resume.
RUN_CONTROL_FIELDS = {
    "output_dir",
    "tiled_loss",  # memory knobs: the same run, summed in another order (resuming with them after an OOM is fine)
    "loss_tile_tokens",
    "tiled_mlp",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "dry_run",
    "local_rank",
    "verify_export",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "save_total_limit",
    "preprocessing_num_workers",
    "cache_dir",
    "max_eval_batches",
    "eval_tasks",
    "eval_tasks_limit",
    "eval_samples",
    "eval_samples_max_new_tokens",
    "eval_on_start",
    "torch_compile",
    "report_to",
    "run_name",
    "merge_lora",
    "reference_cache",  # where a reference is read from, not what it is (the file's own record says that)
}


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
TRACKERS = ("tensorboard", "wandb")  # what `report_to` can name, besides "all" and "none"


DEDUPE_MODES = ("none", "exact", "near")
QUALITY_FILTERS = ("none", "gopher")


def choice(name: str, value, choices, on: str) -> str:
    """A choice option that was a bool once: true means `on`, false `none`, else one of `choices`."""
    text = str(value).strip().lower()
    picked = {"true": on, "yes": on, "1": on, "false": "none", "no": "none", "0": "none"}.get(text, text)
    if picked not in choices:
        raise unknown_choice_error(name, value, choices)
    return picked


def unknown_choice_error(name: str, value: str, choices) -> ConfigError:
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"--{name} '{value}' is not one of {', '.join(choices)}{hint}")


def resolve_path(path: str) -> Path:
    """A relative path is taken from the current directory, else from the repository root, so recipes
    name `ds_configs/zero3.json` and still work when copied and launched from elsewhere."""
    p = Path(os.path.expanduser(path))
    if p.is_absolute() or p.exists():
        return p
    alt = REPO_ROOT / p
    return alt if alt.exists() else p


def validate(cfg: TrainConfig) -> None:
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("bf16 and fp16 are both on; choose one (--bf16 true --fp16 false, or the reverse)")
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "block_size",
    ):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be > 0, got {cfg.learning_rate}")
    if not 0 <= cfg.validation_split_percentage < 100:
        raise ConfigError(f"--validation_split_percentage must be in [0, 100), got {cfg.validation_split_percentage}")
    if cfg.lr_scheduler_type not in lr_schedule.NAMES:
        raise ConfigError(
            f"--lr_scheduler_type '{cfg.lr_scheduler_type}' is not supported; use {', '.join(lr_schedule.NAMES)}"
        )
    if cfg.optim not in OPTIMIZERS:
        raise unknown_choice_error("optim", cfg.optim, OPTIMIZERS)
    if cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise ConfigError("nothing to train: set --max_steps > 0 or --num_train_epochs > 0")
    if cfg.dataset_format not in DATASET_FORMATS:
        raise unknown_choice_error("dataset_format", cfg.dataset_format, DATASET_FORMATS)
    for target in cfg.report_to:
        if target not in (*TRACKERS, "all", "none"):
            raise unknown_choice_error("report_to", target, (*TRACKERS, "all", "none"))
    if cfg.streaming and cfg.max_steps <= 0:
        raise ConfigError("--streaming needs --max_steps > 0: a stream has no length to count epochs in")
    validate_cleaning(cfg)
    if cfg.eval_tasks_limit < 0 or cfg.eval_samples < 0 or cfg.eval_samples_max_new_tokens < 1:
        raise ConfigError(
            "--eval_tasks_limit and --eval_samples must be >= 0 (0: all tasks' examples, no samples) and "
            "--eval_samples_max_new_tokens >= 1"
        )
    if cfg.loss_tile_tokens < 0:
        raise ConfigError(f"--loss_tile_tokens must be >= 0 (0: sized automatically), got {cfg.loss_tile_tokens}")
    if cfg.resume_from_checkpoint is not None and not cfg.resume_from_checkpoint:
        raise ConfigError("--resume_from_checkpoint needs 'auto' or a path")
    lora_options.validate_options(cfg)
    if cfg.objective not in OBJECTIVES:
        raise unknown_choice_error("objective", cfg.objective, OBJECTIVES)
    try:  # a list option arrives as strings from the command line
        cfg.loss_weights = [float(w) for w in cfg.loss_weights] if cfg.loss_weights is not None else None
    except ValueError:
        raise ConfigError(f"--loss_weights expects numbers, one per --loss_type, got {cfg.loss_weights}") from None
    if not cfg.deepspeed and not cfg.dry_run:
        raise ConfigError("no DeepSpeed config given; add e.g. --deepspeed ds_configs/zero3.json")


def validate_cleaning(cfg: TrainConfig) -> None:
    """The cleaning options' ranges (their choices are checked when a TrainConfig is made)."""
    if not 0 < cfg.dedupe_threshold < 1:
        raise ConfigError(f"--dedupe_threshold must be between 0 and 1 (exclusive), got {cfg.dedupe_threshold}")
    if cfg.min_document_tokens < 0:
        raise ConfigError(f"--min_document_tokens must be >= 0, got {cfg.min_document_tokens}")
    if cfg.streaming and cfg.dedupe != "none":
        raise ConfigError(
            f"--dedupe {cfg.dedupe} needs the whole dataset, which --streaming never holds; clean the files once "
            "with tools/clean_data.py (same options) and stream its output"
        )


def parse_inline_or_file(name: str, value: Any) -> Any:
    """A structured option given as a recipe mapping/list, inline JSON, or a JSON/YAML file."""
    if value is None or isinstance(value, (dict, list)):
        return value
    text = str(value).strip()
    if text.startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--{name} inline JSON is invalid at column {e.colno}: {e.msg}") from None
    p = resolve_path(text)
    if not p.is_file():
        raise ConfigError(f"--{name} '{text}' is neither inline JSON nor an existing file")
    try:
        return json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None


def parse_model_config(value: Any) -> Optional[dict]:
    """`model_config` as a dict: from a mapping, an inline JSON object, or a JSON/YAML file."""
    data = parse_inline_or_file("model_config", value)
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"--model_config must be an object of HF config fields, got {type(data).__name__}")
    return data
