"""DeepSpeed JSONs in the shapes other projects ship them, for the table-driven tests of
tests/integration/test_brought_configs_*.py (and their shared blocks, for any test that writes such a file). Written here (not copied) after the files in the HF Trainer's
DeepSpeed docs, axolotl's deepspeed_configs/ and LLaMA-Factory's examples/deepspeed/ as of late 2026, with
their key spellings, their leftovers and their mistakes kept."""

FP16_AUTO = {
    "enabled": "auto",
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
BATCH_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}
ADAMW_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
WARMUP_AUTO = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
}
ZERO3_STAGE3_NAMES = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True,
}
# axolotl's ZeRO-3 files spell these by DeepSpeed's field names, which DeepSpeed accepts as well
ZERO3_FIELD_NAMES = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "sub_group_size": 0,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "max_live_parameters": 0,
    "max_reuse_distance": 0,
    "gather_16bit_weights_on_model_save": True,
}
CPU = {"device": "cpu", "pin_memory": True}

TRAINS = {
    # HF docs, "ZeRO-2 config": optimizer and scheduler blocks, offload_optimizer, 2e8 buckets
    "hf-docs-zero2-offload": {
        "fp16": FP16_AUTO,
        "bf16": {"enabled": "auto"},
        "optimizer": ADAMW_AUTO,
        "scheduler": WARMUP_AUTO,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": CPU,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "contiguous_gradients": True,
        },
        **BATCH_AUTO,
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    },
    # LLaMA-Factory ds_z2_autotp_config.json: ZeRO-2 with AutoTP across 2 ranks
    "llamafactory-autotp": {
        "_comment": "supported model list: ...",
        **BATCH_AUTO,
        "fp16": FP16_AUTO,
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "round_robin_gradients": True, "reduce_bucket_size": 5e8},
        "tensor_parallel": {"autotp_size": 2},
    },
    # HF docs, "ZeRO-3 config": everything offloaded, stage3_* spellings
    "hf-docs-zero3-offload": {
        "fp16": FP16_AUTO,
        "bf16": {"enabled": "auto"},
        "optimizer": ADAMW_AUTO,
        "scheduler": WARMUP_AUTO,
        "zero_optimization": {**ZERO3_STAGE3_NAMES, "offload_optimizer": CPU, "offload_param": CPU},
        **BATCH_AUTO,
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    },
    # axolotl zero1.json: its own AdamW block, fp16 with auto_cast
    "axolotl-zero1": {
        "zero_optimization": {"stage": 1, "overlap_comm": True},
        "bf16": {"enabled": "auto"},
        "fp16": {**FP16_AUTO, "auto_cast": False, "initial_scale_power": 32},
        "optimizer": ADAMW_AUTO,
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    },
    # axolotl zero3_bf16.json: field names (gather_16bit_weights_on_model_save, max_live_parameters, ...)
    "axolotl-zero3-field-names": {
        "zero_optimization": ZERO3_FIELD_NAMES,
        "bf16": {"enabled": True},
        "fp16": {"enabled": "auto"},
        **BATCH_AUTO,
        "wall_clock_breakdown": False,
    },
    # axolotl zero3_bf16_cpuoffload_all.json: field names, offload, its optimizer flags
    "axolotl-zero3-offload-all": {
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {**ZERO3_FIELD_NAMES, "offload_optimizer": CPU, "offload_param": CPU},
        "bf16": {"enabled": True},
        **BATCH_AUTO,
        "wall_clock_breakdown": False,
    },
    # LLaMA-Factory ds_z3_offload_config.json: carries blocks DeepSpeed never reads (comms_config, monitor_config)
    "llamafactory-z3-offload": {
        **BATCH_AUTO,
        "zero_allow_untested_optimizer": True,
        "fp16": FP16_AUTO,
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            **ZERO3_STAGE3_NAMES,
            "overlap_comm": False,
            "offload_optimizer": CPU,
            "offload_param": CPU,
        },
        "comms_config": {"verbose": False},
        "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
    },
    # LLaMA-Factory ds_z3_partial_offload_config.json: optimizer offload only, unpinned
    "llamafactory-z3-optimizer-offload": {
        **BATCH_AUTO,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": True,
        "fp16": FP16_AUTO,
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            **ZERO3_STAGE3_NAMES,
            "overlap_comm": False,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
        },
    },
    # an older config: DeepSpeed's backward-compatible "bfloat16" block, with "auto"
    "old-bfloat16-block": {
        **BATCH_AUTO,
        "bfloat16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "contiguous_gradients": True,
        },
    },
    # an older config: the deprecated names cpu_offload and stage3_gather_fp16_weights_on_model_save
    "old-deprecated-names": {
        **BATCH_AUTO,
        "zero_optimization": {"stage": 3, "cpu_offload": True, "stage3_gather_fp16_weights_on_model_save": True},
    },
}
"""Each trains 2 steps on 2 CPU ranks unchanged."""

REFUSED = {
    # an older ZeRO-2 file: 0.19.8's schema requires reduce_bucket_size > 0
    "old-zero-bucket": (
        {**BATCH_AUTO, "zero_optimization": {"stage": 2, "reduce_bucket_size": 0}},
        'zero_optimization.reduce_bucket_size = 0 must be > 0 (set a size, or "auto")',
    ),
    # both spellings of one key, with different values
    "two-spellings": (
        {**BATCH_AUTO, "zero_optimization": {**ZERO3_STAGE3_NAMES, "max_live_parameters": 1e8}},
        "two names for one DeepSpeed setting",
    ),
    # offload_param under ZeRO-2: DeepSpeed accepts it and offloads nothing
    "zero2-offload-param": (
        {**BATCH_AUTO, "zero_optimization": {"stage": 2, "offload_optimizer": CPU, "offload_param": CPU}},
        "offload_param needs ZeRO-3",
    ),
    # ZeRO++ under ZeRO-2: ignored by DeepSpeed
    "zero2-zeropp": (
        {
            **BATCH_AUTO,
            "zero_optimization": {"stage": 2, "zero_quantized_gradients": True, "zero_hpz_partition_size": 8},
        },
        "ZeRO++ (zero_quantized_gradients, zero_hpz_partition_size) works only with ZeRO-3",
    ),
    # LLaMA-Factory ds_z3_alst_config.json: its own "sequence_parallel" block, read as DeepSpeed's
    # sequence_parallel_size 4, which 2 ranks cannot hold
    "llamafactory-alst": (
        {
            **BATCH_AUTO,
            "zero_optimization": ZERO3_STAGE3_NAMES,
            "sequence_parallel": {"enabled": True, "size": 4, "mode": "ulysses"},
            "bf16": {"enabled": True},
        },
        "2 rank(s) cannot split into sequence-parallel groups of 4",
    ),
    # bf16 block carrying fp16's loss-scaling keys (as LLaMA-Factory's ALST example does): not bf16 fields
    "bf16-with-fp16-keys": (
        {
            **BATCH_AUTO,
            "bf16": {"enabled": True, "auto_cast": False, "loss_scale": 0},
            "zero_optimization": {"stage": 2},
        },
        "bf16.auto_cast is not a key DeepSpeed reads there",
    ),
    # removed in DeepSpeed 0.19: DeepSpeed's own message, as one line
    "removed-sparse-attention": (
        {**BATCH_AUTO, "zero_optimization": {"stage": 2}, "sparse_attention": {"mode": "fixed", "block": 16}},
        "DeepSpeed Sparse Attention has been removed",
    ),
    "removed-onebit-adam": (
        {
            **BATCH_AUTO,
            "zero_optimization": {"stage": 1},
            "optimizer": {"type": "OneBitAdam", "params": {"lr": "auto", "freeze_step": 400}},
        },
        "1-bit Adam was removed from DeepSpeed 0.19",
    ),
    # a typo in a top-level key would silently train at ZeRO-0
    "typo-top-level": (
        {**BATCH_AUTO, "zero_optimisation": {"stage": 3}},
        "top-level key 'zero_optimisation' is not one DeepSpeed reads; did you mean 'zero_optimization'?",
    ),
    # a wrong value inside a nested block
    "offload-to-gpu": (
        {**BATCH_AUTO, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
        "zero_optimization.offload_param.device = 'gpu' must be one of 'none', 'cpu' or 'nvme'",
    ),
    "both-precisions": (
        {**BATCH_AUTO, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
        "bf16 and fp16 are both enabled",
    ),
}
"""Each fails before any process group with one `error:` line containing the text given."""
