"""The settings a user states about a run from another stack (the HF Trainer, LLaMA-Factory, DeepSpeed-Chat,
Axolotl...) that change its memory but are not train.py's: tools/estimate_memory.py's "another stack" options,
and `launch_of`, the one place a Launch is made from the tool's arguments and train.py's config.

- `--zero_init false`: the model is built before DeepSpeed (preloaded.py), with `--deepspeed_version` the
  DeepSpeed it runs (the gathered-weight term depends on it) and `--load_dtype` the dtype it was loaded in.
- `--optim`: the HF Trainer's optimizer names. DeepSpeed's ZeRO hands the client optimizer its flat fp32
  partitions, so what matters is the state each keeps per element and what its step allocates (below).
- `--rope_scaling FACTOR`: a context extended past max_position_embeddings by RoPE scaling. No memory term
  depends on it (the scaled inv_freq is a few KB); it only lifts the length limit.
- `--liger true`: Liger-Kernel's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py):
  the head and loss in chunks of ceil(tokens / ceil(V / h)) rows, rounded up to a power of two, never the whole
  logits, with the head's gradient accumulated across chunks. That is train.py's tiled loss at that tile, and is
  estimated as such. Its SwiGLU and RMSNorm kernels save less than transformers' code: the trace runs stand-ins
  that hold what they hold (liger.py).
"""

from __future__ import annotations

from ..errors import ConfigError

# name: (bytes per element of each of the optimizer's two moments' worth of state, None: the DeepSpeed config's;
#        bytes per stepped element its step allocates on a GPU, None: train.py's rule (states.adam_temporaries))
OPTIMIZERS = {
    "adamw_torch_fused": (None, None),  # train.py's default: fused AdamW, no temporaries
    "adamw_torch": (None, None),  # torch AdamW unfused: foreach on a GPU, one list of temporaries (4 B)
    # bitsandbytes' block-wise 8-bit Adam: both moments in uint8 (1 B each; the fp32 absmax per 256-element block,
    # 1/64 B, is left out); its kernel dequantises in registers, no temporaries. Paged: the same bytes, in memory the
    # driver may page to the host under pressure, so a figure for it is an upper bound on the device
    "adamw_8bit": (1, 0),
    "paged_adamw_8bit": (1, 0),
    # transformers' Adafactor (no first moment by default). ZeRO flattens the parameters into 1-D partitions, so it
    # cannot factor the second moment: a full fp32 exp_avg_sq (4 B, i.e. 2 B for each of the "two moments"), and its
    # step's grad**2 and update temporaries in fp32 (8 B)
    "adafactor": (2, 8),
    "sgd": (0, 0),  # the HF Trainer's SGD: no momentum by default, no state
}
LOAD_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}


def add_arguments(ap) -> None:
    g = ap.add_argument_group("a run from another stack (the HF Trainer, LLaMA-Factory, DeepSpeed-Chat, ...)")
    g.add_argument("--zero_init", choices=["true", "false"], default="true",
                   help="false: the model is built before DeepSpeed (from_pretrained before TrainingArguments): "
                        "ZeRO-3 moves it whole to each GPU first (default true, as train.py)")  # fmt: skip
    g.add_argument("--deepspeed_version", help="with --zero_init false: the DeepSpeed it runs (default: installed)")
    g.add_argument("--load_dtype", choices=sorted(LOAD_DTYPES), default="fp32",
                   help="with --zero_init false: the dtype the model was loaded in (default fp32, transformers 4's)")  # fmt: skip
    g.add_argument("--attn_implementation", choices=["eager", "sdpa", "flash_attention_2", "flash_attention_3",
                                                     "flex_attention"], help="default: the recipe's, else sdpa")  # fmt: skip
    g.add_argument("--optim", choices=list(OPTIMIZERS), help="the HF Trainer's --optim (default adamw_torch_fused)")
    g.add_argument("--rope_scaling", type=float, help="RoPE scaling factor: allows --seq_len up to "
                                                      "max_position_embeddings x it")  # fmt: skip
    g.add_argument(
        "--liger",
        choices=["true", "false"],
        help="Liger-Kernel's kernels (fused linear cross-entropy, SwiGLU, RMSNorm)",
    )


def check(args) -> None:
    if args.zero_init == "true" and (args.deepspeed_version or args.load_dtype != "fp32"):
        raise ConfigError("--deepspeed_version and --load_dtype describe a model built before DeepSpeed; add "
                          "--zero_init false, or drop them")  # fmt: skip
    if args.deepspeed_version:
        from .preloaded import version_tuple

        try:
            version_tuple(args.deepspeed_version)
        except ValueError:
            raise ConfigError(
                f"--deepspeed_version {args.deepspeed_version!r} is not a version; write it like 0.14.2"
            ) from None
    if args.rope_scaling is not None and args.rope_scaling <= 1:
        raise ConfigError(f"--rope_scaling is the factor the context is extended by, above 1; got {args.rope_scaling}")
    if args.liger == "true" and getattr(args, "tiled_loss", None) == "false":
        raise ConfigError("--liger true computes the loss in chunks; drop --tiled_loss false")


def train_argv(args) -> list[str]:
    """What of these train.py parses itself: attention and its own two optimizers."""
    argv = ["--attn_implementation", args.attn_implementation] if getattr(args, "attn_implementation", None) else []
    if getattr(args, "optim", None) in ("adamw_torch_fused", "adamw_torch"):
        argv += ["--optim", args.optim]
    return argv


def scaled_positions(args, config, seq_len: int) -> None:
    """--seq_len within max_position_embeddings, or within it x --rope_scaling (the context the run extends to)."""
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None)
    factor = getattr(args, "rope_scaling", None)
    if not positions or seq_len <= positions * (factor or 1):
        if positions and factor:
            text.max_position_embeddings = int(positions * factor)
        return
    if not factor:
        raise ConfigError(f"--seq_len {seq_len} exceeds the model's max_position_embeddings {positions}; give "
                          f"--rope_scaling {-(-seq_len // positions)} if the run extends the context with RoPE "
                          f"scaling, or --seq_len {positions} or less")  # fmt: skip
    raise ConfigError(f"--seq_len {seq_len} is past max_position_embeddings {positions} x --rope_scaling "
                      f"{factor:g} = {int(positions * factor)}; raise the factor or shorten it")  # fmt: skip


def use_liger(launch, config, kernels: bool = True) -> None:
    """Liger on a Launch: its fused linear cross-entropy as the loss tiled at Liger's chunk, and with `kernels` its
    SwiGLU and RMSNorm in the trace too (liger.py)."""
    launch.tiled_loss, launch.liger = True, kernels
    launch.loss_tile_tokens = liger_chunk(launch.micro_batch_size * launch.seq_len, config)


def liger_chunk(tokens: int, config) -> int:
    """Liger's fused linear cross-entropy chunk: ceil(tokens / ceil(V / h)), rounded up to a power of two."""
    text = config.get_text_config()
    inc = -(-text.vocab_size // text.hidden_size)
    rows = -(-tokens // inc)
    return 1 << (rows - 1).bit_length()


def launch_of(args, cfg, config, num_gpus: int, checkpointing: bool, micro: int | None = None, **kw):
    """The Launch of one estimate: train.py's settings from its config, the stack's from the arguments."""
    from zero_recipes.modeling import lm_loss

    from .launch import Launch
    from .preloaded import Preloaded, installed_deepspeed, version_tuple

    micro = micro or cfg.per_device_train_batch_size
    launch = Launch(num_gpus, args.num_nodes, micro, cfg.block_size, checkpointing, cfg.attn_implementation or "sdpa",
                    tiled_loss=lm_loss.tiles_loss(cfg), loss_tile_tokens=cfg.loss_tile_tokens, tiled_mlp=cfg.tiled_mlp,
                    optim=cfg.optim, objective=cfg.objective, **kw)  # fmt: skip
    if getattr(args, "expert_imbalance", None):
        launch.expert_imbalance = args.expert_imbalance
    if getattr(args, "zero_init", "true") == "false":
        version = version_tuple(args.deepspeed_version) if args.deepspeed_version else installed_deepspeed()
        launch.preloaded = Preloaded(version, LOAD_DTYPES[args.load_dtype])
    moments, temporaries = OPTIMIZERS.get(getattr(args, "optim", None) or "", (None, None))
    launch.moment_bytes, launch.optimizer_temporaries = moments, temporaries
    if getattr(args, "liger", None) == "true":
        use_liger(launch, config)
    return launch


def notes(args) -> list[str]:
    """What the estimate assumed of the stack's settings."""
    out = []
    optim = getattr(args, "optim", None)
    if optim in ("adamw_8bit", "paged_adamw_8bit"):
        out.append(
            f"optimizer {optim}: bitsandbytes' moments in 1 byte each"
            + ("; paged, so the driver may move them to the host under pressure" if optim.startswith("paged") else "")
        )
    elif optim == "adafactor":
        out.append("optimizer adafactor: ZeRO's flat partitions leave it a full fp32 second moment (no factoring)")
    if getattr(args, "rope_scaling", None):
        out.append(f"RoPE scaled x{args.rope_scaling:g}: the context only; no memory term depends on it")
    if getattr(args, "liger", None) == "true":
        out.append(
            "Liger: the fused linear cross-entropy's chunks as the tiled loss, its SwiGLU and RMSNorm as their "
            "kernels hold memory (memory/liger.py)"
        )
    return out
