"""A stop asked for by a signal (Ctrl-C, a scheduler's SIGTERM or SIGUSR1), agreed by every rank at a step boundary."""

from __future__ import annotations

import os


class StopRequest:
    """A stop asked for: Ctrl-C (SIGINT), SIGTERM or SIGUSR1 (what Slurm and cloud schedulers send before
    taking a node) asks for a checkpoint and a clean exit at the next step boundary. Launchers signal ranks
    one at a time or only some of them, so the ranks agree at each boundary with one tiny all-reduce on a
    gloo group (on GPUs a separate one, so it never waits on the CUDA stream).

    Ctrl-C reaches a rank twice: the terminal sends SIGINT to every process in the foreground group, and
    the deepspeed launcher, on its own SIGINT, sends SIGTERM to every rank (launch.py, 0.19.8). So a rank
    cannot tell Ctrl-C from a scheduler's SIGTERM, and its stop line names both. A second signal more than
    REPEAT_AFTER seconds after the first is the user insisting: it exits at once."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")
    REPEAT_AFTER = 2.0  # seconds: the launcher's SIGTERM follows the terminal's SIGINT within milliseconds

    def __init__(self):
        import signal

        import torch.distributed as dist

        self.received: str | None = None
        self.at = 0.0
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        import signal
        import time

        if self.received is not None:
            if time.monotonic() - self.at > self.REPEAT_AFTER:
                os._exit(128 + signum)
            return
        self.received, self.at = signal.Signals(signum).name, time.monotonic()

    @staticmethod
    def describe(name: str) -> str:
        """What the user or the scheduler did, as the stop line says it."""
        return "Ctrl-C / SIGTERM" if name in ("SIGINT", "SIGTERM") else name

    def agreed(self) -> str | None:
        """Collective: the signal any rank received, or None. Call at the same point on every rank."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([self.SIGNALS.index(self.received) + 1 if self.received else 0], dtype=torch.int32)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        return self.SIGNALS[int(mine.item()) - 1] if int(mine.item()) else None
