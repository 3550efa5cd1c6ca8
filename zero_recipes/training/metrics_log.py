"""What a run logs: the steps' window of loss and throughput (LogWindow), metrics.jsonl with its trackers
(MetricsLog), the memory figures of a record, and which trackers `--report_to` resolves to."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.training.flops import mfu


def memory_stats() -> dict:
    import torch

    out = {}
    if torch.cuda.is_available():
        out["mem_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
        out["mem_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    try:
        import psutil

        out["cpu_rss_gb"] = psutil.Process().memory_info().rss / 2**30
    except ImportError:
        pass
    return out


def report_targets(report_to: list[str]) -> list[str]:
    """`report_to` resolved: 'all' is every tracker, 'none' none. A tracker asked for (the default
    TensorBoard included; it is in requirements.txt) must be installed: the error names the install."""
    import importlib.util

    from zero_recipes.config.train_config import TRACKERS
    from zero_recipes.errors import ConfigError

    wanted = [] if "none" in report_to else list(TRACKERS) if "all" in report_to else list(report_to)
    for name in wanted:  # each tracker's package has its name
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"--report_to {name} needs the {name} package: pip install {name} (or --report_to none)")
    return wanted


class LogWindow:
    """The steps since the last metrics record: their summed loss (kept on the device: no host sync until
    `record`), their data wait and their wall time. Eval and checkpoint saves are not training
    throughput: time spent inside `paused()` is left out."""

    def __init__(
        self,
        device,
        tokens_per_step_rank: int,
        losses_per_step: int,
        flops_per_token: float,
        peak_flops: float,
        group: int = 1,
        loss_shares: int = 1,
    ):
        import torch

        self.loss_sum = torch.zeros((), device=device)
        self.aux_sum = torch.zeros(2, device=device)  # a mixture of experts' balancing losses, and their count
        self.has_aux = False
        self.means: dict = {}  # an objective's metrics: name -> [sum, count] on the device
        self.tokens_per_step_rank, self.losses_per_step = tokens_per_step_rank, losses_per_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        # `tokens_per_step_rank` counts a data-parallel replica's rows; `group` ranks train them together (a TP
        # or SP group): count them once. Under SP each rank's loss is its slice's share (`loss_shares` = SP size).
        self.group, self.loss_shares = group, loss_shares
        self._restart()

    def _restart(self) -> None:
        self.steps, self.data_wait, self.tokens, self.start = 0, 0.0, 0, time.perf_counter()

    def add_loss(self, loss) -> None:
        self.loss_sum += loss.detach()

    def add_aux(self, aux) -> None:
        self.aux_sum[0] += aux.float()
        self.aux_sum[1] += 1
        self.has_aux = True

    def add_means(self, means: dict) -> None:
        """name -> (sum, count) of a step, as device tensors; recorded as sum / count over the window and ranks."""
        import torch

        for name, (total, count) in means.items():
            acc = self.means.setdefault(name, torch.zeros(2, dtype=torch.float64, device=total.device))
            acc[0] += total
            acc[1] += count

    def add_step(self, data_wait: float, tokens: int | None = None) -> None:
        """One step done; `tokens`: what it computed on this rank when rows vary (pairs), else the fixed count."""
        self.steps += 1
        self.data_wait += data_wait
        self.tokens += self.tokens_per_step_rank if tokens is None else tokens

    @contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - t

    def record(self) -> dict:
        """Collective (one all-reduce and one .item(), the loop's only host sync): the window's mean loss
        over every rank and micro-batch, and its throughput. Starts the next window."""
        import torch.distributed as dist

        dist.all_reduce(self.loss_sum)  # a TP group's ranks hold the same loss: the mean over all is theirs
        aux = None
        if self.has_aux:  # every rank trains the same model: all have balancing losses, or none
            dist.all_reduce(self.aux_sum)
            aux = (self.aux_sum[0] / self.aux_sum[1]).item()
            self.aux_sum.zero_()
        means = {}
        if self.means:  # one all-reduce for all of them (every rank has the same names: the same objective)
            import torch

            stacked = torch.stack(list(self.means.values()))
            dist.all_reduce(stacked)
            means = {name: s / c for name, (s, c) in zip(self.means, stacked.tolist()) if c}
            self.means = {}
        world = dist.get_world_size()
        loss = self.loss_sum.item() * self.loss_shares / (self.steps * self.losses_per_step * world)
        elapsed = time.perf_counter() - self.start
        tps = self.tokens / elapsed / self.group  # each device's share of its group's
        out = {
            "loss": loss,
            "tokens_per_sec": tps * world,
            "tokens_per_sec_per_device": tps,
            "mfu": mfu(tps, self.flops_per_token, self.peak_flops),
            "data_wait_frac": self.data_wait / elapsed,
        }
        if aux is not None:
            out["aux_loss"] = aux
        out.update(means)
        self.loss_sum.zero_()
        self._restart()
        return out


class MetricsLog:
    """One JSON object per line in output_dir/metrics.jsonl (rank 0 only), appended across resumes, and the
    same scalars to TensorBoard and W&B when asked. A resume from step N first drops the records after N,
    which the interrupted launch wrote and the resumed one writes again, so each step appears once."""

    def __init__(
        self,
        path: Path,
        enabled: bool,
        resumed_at: int | None = None,
        report_to: tuple = (),
        run_name: str | None = None,
        config: dict | None = None,
    ):
        self.enabled, self.path, self.warned = enabled, path, False
        if enabled and resumed_at is not None and path.exists():
            keep = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resumed_at
            ]
            self.guard(lambda: atomic.write_text(path, "".join(line + "\n" for line in keep)))
        self.f = open(path, "ab", buffering=0) if enabled else None  # unbuffered: a line is written or cut back
        self.tb = self.wandb = None
        if enabled and "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step makes TensorBoard hide what the interrupted launch logged after the resume point,
            # as the jsonl trim above does
            self.tb = SummaryWriter(
                str(path.parent / "tensorboard"),
                flush_secs=30,
                purge_step=None if resumed_at is None else resumed_at + 1,
            )
        if enabled and "wandb" in report_to:
            import wandb

            # one W&B run per output_dir: a resumed launch continues it instead of starting a new one
            id_file = path.parent / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
            id_file.write_text(run_id)
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "zero-recipes"),
                id=run_id,
                name=run_name or path.parent.resolve().name,
                dir=str(path.parent),
                resume="allow",
                config=config,
            )
        _OPEN.append(self)

    def write(self, record: dict) -> None:
        if not self.f:
            return
        # floats at full precision: resume tests compare losses bit for bit
        self.guard(lambda: self.append((json.dumps(record) + "\n").encode()))
        # HF's tag names (train/loss, eval/loss), so dashboards built for the Trainer read these runs
        scalars = {
            (f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self.tb:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, record["step"])
        if self.wandb:
            self.wandb.log(scalars, step=record["step"])

    def append(self, line: bytes) -> None:
        """The whole line or nothing: a write cut short by a full disk is truncated back, so a reader never
        meets half a record."""
        start = os.fstat(self.f.fileno()).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[self.f.write(view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.f.fileno(), start)
            raise

    def guard(self, write) -> None:
        """metrics.jsonl is a record of the run, not the run: a write that storage refuses costs that record
        and one warning per launch (storage.or_warn)."""
        then = "training goes on; later records are appended once there is room (no partial line is left)"
        self.warned |= not storage.or_warn(write, str(self.path), then, quiet=self.warned)

    def close(self) -> None:
        if self.f:
            self.f.close()
            self.f = None
        if self.tb:
            self.tb.close()
            self.tb = None
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


_OPEN: list[MetricsLog] = []


def close_open_logs() -> None:
    """Flush every tracker before a failing run exits (train.py leaves with os._exit, so no atexit runs)."""
    while _OPEN:
        try:
            _OPEN.pop().close()
        except Exception:
            pass
