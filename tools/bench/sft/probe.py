"""What the SFT benchmark reads from inside each runner's ranks, the same way for all three.

A forward pre-hook on the model (the module DeepSpeed wraps) stamps every training micro-batch with its start
time and its tokens (sft_data.batch_tokens); eval forwards (no grad) are not recorded. A step ends when the
next begins, so windows of steps are timed at the same point in every runner, whatever loop drives it. On a
GPU the hook first waits for the device (`wait_for`): kernels run after their launch returns, so without it a
stamp would time the host's launches, ahead of the work by however much was queued. At the end rank 0 scores
the trained model on the same held-out conversations (one per forward, no padding, loss summed over the
assistant's tokens, on the model's device), and every rank writes <probe_out>.rank<N>.json with its records,
its time to first step (process start to the second training forward, i.e. the first step done) and its peak
RSS.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from .data import batch_tokens, masked_example


def wait_for(device) -> None:
    """Block until the device has run what was queued on it (CUDA); nothing on the CPU, which runs as it goes."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model):
    """Where the model's weights are, so its inputs go there (under ZeRO-3 a parameter is an empty placeholder
    on the same device)."""
    return next(model.parameters()).device


class StepProbe:
    def __init__(self, wait=wait_for):
        self.wait = wait  # the device's sync, before every stamp
        self.pad_id = 0
        self.starts: list[float] = []
        self.tokens: list[tuple[int, int, int]] = []  # (computed, trained, real) per micro-batch
        self.first_step_seconds = None

    def attach(self, model, pad_id: int) -> None:
        self.pad_id = pad_id
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        import psutil
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return
        self.wait(kwargs["input_ids"].device)  # the previous step's kernels done: then read the clock
        if len(self.starts) == 1:
            self.first_step_seconds = time.time() - psutil.Process().create_time()
        self.starts.append(time.perf_counter())
        self.tokens.append(batch_tokens(kwargs, self.pad_id))

    def finish(self, model, rank: int, out: str, eval_file: str, tok, max_length: int) -> None:
        record = {
            "rank": rank,
            "starts": self.starts,
            "tokens": self.tokens,
            "time_to_first_step": self.first_step_seconds,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if rank == 0 and eval_file:
            record.update(held_out_loss(model, eval_file, tok, max_length))
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(record) + "\n")


def held_out_loss(model, eval_file: str, tok, max_length: int) -> dict:
    """Mean loss per assistant token over the conversations in eval_file, each alone in its forward."""
    rows = [json.loads(line)["messages"] for line in Path(eval_file).read_text().splitlines()]
    total, count = held_out_sums(model, rows, tok, max_length)
    return {"eval_loss": float(total) / count, "eval_tokens": count}


def held_out_sums(model, rows: list, tok, max_length: int):
    """The summed loss over the assistant's tokens of each conversation in `rows` (a tensor on the model's
    device: read once by the caller, not once a conversation), and the number of those tokens."""
    import torch

    was_training, device = model.training, model_device(model)
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0  # as the float sum it replaced
    with torch.no_grad():
        for messages in rows:
            ex = masked_example(messages, tok, max_length)
            ids = torch.tensor([ex["input_ids"]], device=device)
            targets = torch.tensor([ex["labels"][1:]], device=device)
            logits = model(input_ids=ids, use_cache=False).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )
            count += sum(label != -100 for label in ex["labels"][1:])
    model.train(was_training)
    return total, count
