"""The training loop: `fit` runs optimizer steps to the plan's total and calls the objects that log,
evaluate, guard against a non-finite loss and checkpoint. How one step runs is the runner's (runner.py): `fit`
never asks which mode the run is in.

Every rank runs the same collectives in the same order: the step's label-token count (SFT), the
non-finite check and the loss all-reduce at logging/saving steps, eval, the preemption agreement, the save.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import psutil
import torch

from zero_recipes import data
from zero_recipes.checkpointing.checkpoint import Checkpointer
from zero_recipes.checkpointing.storage import StorageError
from zero_recipes.distributed.preemption import StopRequest
from zero_recipes.plan import RunPlan
from zero_recipes.training import device_peak, flops, metrics_log
from zero_recipes.training.loss_rise import LossRiseWatch


@dataclass
class Loop:
    """What the loop reads and calls; built once in train.py."""

    engine: object
    runner: object
    """How one optimizer step and one eval batch run (runner.EagerRunner)."""
    plan: RunPlan
    order: object  # data.BatchOrder or the streamed equivalent: next_batch(), epoch_progress, state_dict()
    prepared: object  # data.Prepared: eval rows, pad id, whether labels are SFT-masked
    log_file: metrics_log.MetricsLog
    checkpointer: Checkpointer
    stop: StopRequest
    rank: int
    log: Callable[..., None]
    live_eval: Optional[object] = None
    """--eval_tasks / --eval_samples on the live model at each evaluation (evaluation.in_training.LiveEval)."""


@dataclass(frozen=True)
class Outcome:
    step: int
    exit_code: int = 0
    preempted: bool = False

    @property
    def finished(self) -> bool:
        return self.exit_code == 0 and not self.preempted


class NonFiniteGuard:
    """The first step with a NaN/inf loss, kept on the device so the loop never syncs for it; `check` asks
    every rank (one all-reduce) before anything is logged or saved, so no NaN checkpoint is ever written."""

    NONE = 2**62

    def __init__(self, device):
        self.first_bad = torch.zeros((), dtype=torch.long, device=device)

    def observe(self, loss, step: int) -> None:
        self.first_bad = torch.where((self.first_bad == 0) & ~torch.isfinite(loss.detach()), step, self.first_bad)

    def check(self) -> Optional[int]:
        """Collective: the first step any rank saw a non-finite loss, or None."""
        bad = torch.where(self.first_bad > 0, self.first_bad, torch.full_like(self.first_bad, self.NONE))
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MIN)
        return None if bad.item() >= self.NONE else int(bad.item())


def fit(loop: Loop, step: int) -> Outcome:
    """Train from `step` to the plan's total. Logs every `logging_steps`, evaluates every `eval_steps`,
    saves every `save_steps` and at the end; on a preemption signal saves and returns early."""
    engine, cfg, total = loop.engine, loop.plan.cfg, loop.plan.total_steps
    window = open_window(loop)
    guard, bar = NonFiniteGuard(engine.device), progress_bar(loop.rank, total, step)
    start_step, run_start = step, time.perf_counter()
    time_to_first_step = None  # from process start (imports included) to the end of this launch's first step
    losses: list[float] = []
    rise = LossRiseWatch.for_launch(loop.plan, step)  # a fine-tune's early loss rise: one warning
    if cfg.eval_on_start and step == 0:
        with window.paused():
            run_eval(loop, 0)
    engine.train()
    own_grad_norm = None
    while step < total:
        logging_step = (step + 1) % cfg.logging_steps == 0 or step + 1 == total
        micro_batches, data_wait = next_micro_batches(loop)
        losses_of_step, norm = loop.runner.train_step(micro_batches, logging_step)
        for loss in losses_of_step:
            window.add_loss(loss)
            guard.observe(loss, step + 1)
        for aux in loop.runner.step_aux:  # a mixture of experts' balancing loss, logged as aux_loss
            window.add_aux(aux)
        window.add_means(getattr(loop.runner, "step_means", {}))  # an objective's own metrics (DPO's rewards)
        own_grad_norm = norm if norm is not None else own_grad_norm
        step += 1
        if step == start_step + 1:
            time_to_first_step = time.time() - psutil.Process().create_time()
        window.add_step(data_wait, getattr(loop.runner, "step_tokens", None))  # pairs: the tokens they hold
        bar.update(1)
        saving = (cfg.save_steps and step % cfg.save_steps == 0) or step == total
        if saving or step % cfg.logging_steps == 0:
            bad = guard.check()
            if bad is not None:
                bar.close()
                return stop_non_finite(loop, bad, step)
        if step % cfg.logging_steps == 0 or step == total:
            first = step - window.steps == start_step
            record = log_record(loop, window, step, own_grad_norm, time_to_first_step if first else None)
            losses.append(record["loss"])
            if (warning := rise.observe(step, record["loss"])) and loop.rank == 0:
                bar.write(warning)  # above the bar, as the checkpoint lines are
            bar.set_postfix(
                loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_sec']:.0f}"
            )
        if (cfg.eval_steps and step % cfg.eval_steps == 0) or step == total:
            with window.paused():
                run_eval(loop, step)
            engine.train()
        if (outcome := save_or_stop(loop, window, bar, step, saving)) is not None:
            return outcome
    bar.close()
    summarise(loop, start_step, step, time.perf_counter() - run_start, losses)
    return Outcome(step)


def save_or_stop(loop: Loop, window: metrics_log.LogWindow, bar, step: int, saving: bool) -> Optional[Outcome]:
    """Collective: agree on a preemption signal, save when it is time or when asked to stop, and return the
    outcome that ends the launch early (None: train on)."""
    total = loop.plan.total_steps
    preempted = loop.stop.agreed()
    if saving or preempted:
        with window.paused():
            try:
                path = loop.checkpointer.save(loop.engine, step, rank_state={"data": loop.order.state_dict()})
            except StorageError:
                bar.close()  # so that the error's one line starts a line of its own, not after the bar
                raise
        bar.write(f"checkpoint: {path}") if loop.rank == 0 else None
    if not (preempted and step < total):
        return None
    bar.close()
    loop.log(
        f"stop requested ({loop.stop.describe(preempted)}): checkpoint saved at {path} (step {step} of {total}). Resume "
        "by launching the same command again (it continues from there), or with --resume_from_checkpoint auto"
    )
    return Outcome(step, preempted=True)


def next_micro_batches(loop: Loop) -> tuple[list[dict], float]:
    """One optimizer step's micro-batches on the device, and the seconds spent waiting for them."""
    t = time.perf_counter()
    steps = loop.plan.cfg.gradient_accumulation_steps
    micro_batches = [loop.runner.micro_batch(loop.order.next_batch()) for _ in range(steps)]
    return micro_batches, time.perf_counter() - t


def summarise(loop: Loop, start_step: int, step: int, seconds: float, losses: list[float]) -> None:
    if step > start_step:
        loop.log(f"train: {step - start_step} steps in {seconds:.1f}s, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    else:
        loop.log(f"train: already at step {step} of {loop.plan.total_steps}; nothing left to train")


def stop_non_finite(loop: Loop, bad_step: int, step: int) -> Outcome:
    loop.log(
        f"error: the loss became non-finite (NaN or inf) at step {bad_step}; stopping without saving a "
        f"checkpoint. Lower --learning_rate, keep --max_grad_norm on, or use bf16 instead of fp16; the last "
        f"good checkpoint is {loop.checkpointer.latest_tag() or 'none'}"
    )
    return Outcome(step, exit_code=1)


def open_window(loop: Loop) -> metrics_log.LogWindow:
    """The first logging window, after the line that states the run's size and the peak MFU is taken against."""
    plan, cfg = loop.plan, loop.plan.cfg
    peak, peak_source = device_peak.device_peak_flops(plan.precision, data.cache_root(cfg) / "matmul-peak.json")
    trainable = flops.trainable_matmul_params(loop.engine.module)  # LoRA: frozen weights get no weight grads
    flops_per_token = flops.model_flops_per_token(plan.model_config, cfg.block_size, trainable)
    loop.log(
        f"plan: {plan.total_steps} steps x {plan.global_batch} {plan.objective.rows} x {cfg.block_size} tokens; "
        f"{flops_per_token / 1e6:.1f} MFLOP/token; peak {peak / 1e12:.2f} TFLOP/s ({peak_source})"
    )
    tokens_per_step_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.block_size
    return metrics_log.LogWindow(
        loop.engine.device,
        tokens_per_step_rank,
        cfg.gradient_accumulation_steps,
        flops_per_token,
        peak,
        group=plan.mesh.group,
        loss_shares=plan.mesh.loss_shares(plan.zero_stage),
    )


def log_record(
    loop: Loop, window: metrics_log.LogWindow, step: int, own_grad_norm, time_to_first_step: Optional[float]
) -> dict:
    """Collective: one metrics record for the window that ends at `step`, written to every tracker.
    `time_to_first_step` goes into the first record of a launch (None in the others)."""
    w = window.record()
    grad_norm = loop.engine.get_global_grad_norm()
    grad_norm = own_grad_norm if grad_norm is None else grad_norm
    record = {
        "step": step,
        "epoch": round(loop.order.epoch_progress, 4),
        "loss": w.pop("loss"),
        "lr": loop.engine.get_lr()[0],
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        **w,
        **metrics_log.memory_stats(),
    }
    if time_to_first_step is not None:
        record["time_to_first_step"] = time_to_first_step
    loop.log_file.write(record)
    return record


def run_eval(loop: Loop, step: int) -> None:
    shard, shards = loop.plan.mesh.eval_shard(loop.rank)
    # an objective's own evaluation where its runner has one (DPO: reward accuracy and margins)
    ev = getattr(loop.runner, "evaluate", partial(evaluate, loop.runner))(loop.prepared, loop.plan.cfg, shard, shards)
    if loop.live_eval is not None:
        ev.update(loop.live_eval.run(loop.engine, step))
    if ev:
        loop.log_file.write({"step": step, **ev})
        loop.log(f"eval: step {step} {format_eval(ev)}")


def evaluate(runner, prepared, cfg, shard: int, shards: int) -> dict:
    """Token-weighted eval loss over the label tokens, and for SFT the exact-match accuracy: the share
    of eval examples whose every answer token is the model's argmax. Teacher-forced argmax on every
    answer token is exactly what greedy decoding would produce, so this is greedy exact match at the
    cost of one forward pass (and the same collectives on every rank, as ZeRO-3 needs). The rows are sharded
    `shards` ways (mesh.Mesh.eval_shard) and summed over the runner's count group, so each row counts once."""
    engine = runner.engine
    engine.eval()
    device = engine.device
    total = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, label tokens, matches, examples
    with torch.no_grad():
        for batch, weight in data.eval_batches(
            prepared.eval, cfg.per_device_eval_batch_size, shard, shards, cfg.max_eval_batches, prepared.pad_id
        ):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}  # host ints stay
            weight = weight.to(device)
            loss_sum, n, wrong = runner.eval_rows(batch)
            total[0] += (loss_sum * weight).sum()
            total[1] += (n * weight).sum()
            if prepared.exact_match:
                has_answer = n > 0
                total[2] += (((wrong == 0) & has_answer) * weight).sum()
                total[3] += (has_answer * weight).sum()
    torch.distributed.all_reduce(total, group=runner.count_group)
    if total[1].item() == 0:
        return {}
    loss = (total[0] / total[1]).item()
    out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50))}
    if prepared.exact_match and total[3].item() > 0:
        out["eval_exact_match"] = (total[2] / total[3]).item()
    return out


def format_eval(ev: dict) -> str:
    parts = [f"loss {ev['eval_loss']:.4f}"] if "eval_loss" in ev else []
    parts += [f"perplexity {ev['eval_perplexity']:.2f}"] if "eval_perplexity" in ev else []
    parts += [f"exact match {ev['eval_exact_match']:.1%}"] if "eval_exact_match" in ev else []
    tasks = {k[5:]: v for k, v in ev.items() if k.startswith("eval_") and k not in KNOWN_EVAL and "seconds" not in k}
    parts += [f"{name} {v:.4f}" for name, v in tasks.items()]
    parts += [f"({ev[k]:.1f} s {k[5:-8]})" for k in ("eval_tasks_seconds", "eval_samples_seconds") if k in ev]
    return " ".join(parts)


KNOWN_EVAL = ("eval_loss", "eval_perplexity", "eval_exact_match")


def progress_bar(rank: int, total: int, initial: int):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        disable=rank != 0,
        desc="train",
        unit="step",
        mininterval=1.0,
        dynamic_ncols=True,
        file=sys.stderr,
    )
