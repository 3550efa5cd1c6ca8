"""The GPU benchmark's one-device stand-in for TP2, SP2 and PP2: one rank's compute at the split shapes.

    PYTHONPATH=tools python -m bench.gpu.shapes '<spec JSON>' OUT.json

Two ranks cannot share one GPU under NCCL, so the collectives are not run; what one rank computes is. In this
process, on the device (CUDA, else the CPU), each shape is built from its config (random init, `spec`'s
precision, sdpa) and timed over `steps` forward+backward passes on random tokens (micro x seq), after one
warm-up pass; each parameter's gradient is dropped as it is made, as ZeRO takes it into its buffers:
- full model: the reference;
- TP2 rank: one AutoTP rank's widths (zero_recipes/memory/tensor_parallel.local_config: heads, key-value heads
  and the MLP halved, head_dim and the residual stream whole, the vocabulary whole);
- SP2 rank: the sequence halved with every head's attention over it. A Ulysses rank runs its projections and
  MLP on seq/2 tokens, as here, but attends over all seq tokens with half the heads: twice this attention;
- PP2 stage: half the layers, with both the embedding and the head (each real stage has one of them).
Per shape: the median pass's tokens/s and MFU (zero_recipes.training.flops' FLOPs, device_peak's peak), and the
activation peak of one pass (weights excluded) against zero_recipes.memory.activation_bytes for the same shape.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path


def shapes(fields: dict, block: int) -> dict:
    """name: (HF config, sequence length) of each shape, from the full model's fields."""
    from transformers import AutoConfig

    from zero_recipes.memory.tensor_parallel import local_config

    rest = {k: v for k, v in fields.items() if k != "model_type"}
    full = AutoConfig.for_model(fields["model_type"], **rest)
    stage = copy.deepcopy(full)
    stage.num_hidden_layers = full.num_hidden_layers // 2
    return {
        "full model": (full, block),
        "TP2 rank": (local_config(full, 2), block),
        "SP2 rank": (full, block // 2),
        "PP2 stage": (stage, block),
    }


def drop_grad(param) -> None:
    param.grad = None


def activation_peak(model, config, micro: int, seq: int, step, device: str) -> int:
    """Bytes allocated at the peak of one forward+backward over those held before it."""
    import torch

    if device == "cpu":
        from zero_recipes.memory.probe import fwd_bwd_peak_bytes

        return fwd_bwd_peak_bytes(model, config, micro, seq)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(config, seq: int, spec: dict, device: str, peak: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from zero_recipes.memory import activation_bytes
    from zero_recipes.training import flops

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec["precision"]]
    micro = spec["micro"]
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(drop_grad)
    ids = torch.randint(0, config.vocab_size, (micro, seq), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    step()  # warm-up: kernels chosen, workspaces allocated
    sync()  # its kernels done before the first timed pass starts the clock
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    measured = activation_peak(model, config, micro, seq, step, device)
    seconds = statistics.median(times)
    tokens_per_sec = micro * seq / seconds
    predicted = activation_bytes(config, micro, seq, dtype, False, tiled_loss=False).bytes
    return {
        "seq": seq,
        "micro": micro,
        "heads": config.num_attention_heads,
        "layers": config.num_hidden_layers,
        "intermediate_size": config.intermediate_size,
        "step_seconds": seconds,
        "tokens_per_sec": tokens_per_sec,
        "mfu": flops.mfu(tokens_per_sec, flops.model_flops_per_token(config, seq), peak),
        "activation_peak_bytes": measured,
        "activation_estimate_bytes": predicted,
        "estimate_error": predicted / measured - 1 if measured else None,
    }


def main(argv: list[str]) -> int:
    spec, out = json.loads(argv[0]), Path(argv[1])
    import torch

    from zero_recipes.training import device_peak

    device = "cuda" if torch.cuda.is_available() else "cpu"
    peak, source = device_peak.device_peak_flops(spec["precision"])
    results = {}
    for name, (config, seq) in shapes(spec["model"], spec["block"]).items():
        results[name] = measure(config, seq, spec, device, peak)  # its model freed on return
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{name}: {results[name]['tokens_per_sec']:,.0f} tokens/s", flush=True)
    out.write_text(json.dumps({"device": device, "peak_flops": peak, "peak_source": source, "shapes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
