"""Is the host quiet enough to time on? Other processes' CPU use, before a benchmark starts and while it runs.

On the 2-core hosts these reports come from, one other job (a test suite, another benchmark) takes half the
machine: a text report timed beside a test suite ran at 140-156 tokens/s where a quiet host gives 180-240, and
its ratio pointed the other way. Paired ratios cancel load that drifts slowly, not load that comes and goes within a
round. So a timed benchmark refuses to start while other processes use more than BUSY_CORES of a core (one
line, exit 2; `--allow-loaded` measures anyway), and every report says what the rest of the host did while it
ran: a thread samples every process outside the benchmark's own tree (itself, its launchers and ranks) every
PERIOD seconds (about 10-30 ms of CPU per sample), and the report is marked loaded when they used more than
BUSY_CORES in LOADED_SHARE or more of the samples.

The 1-minute load average is recorded beside it but decides nothing: it counts the benchmark's own ranks and
lags a minute behind, so it stays high after the previous benchmark ends and low while a new job starts.
Kernel threads are left out: the ranks' own collectives (gloo over loopback) run partly in them.
"""

from __future__ import annotations

import os
import threading
import time

BUSY_CORES = 0.25
PERIOD = 5.0
LOADED_SHARE = 0.1
SAMPLE_BEFORE = 3.0  # seconds of sampling before a timed benchmark starts


class Sampler:
    """CPU seconds used by the processes outside `root`'s tree since the previous call, and by whom."""

    def __init__(self, root: int | None = None):
        import psutil

        self.psutil, self.root = psutil, root or os.getpid()
        self.seen: dict[tuple[int, float], float] = {}
        self.last, self.last_wall = time.monotonic(), 0.0
        self.sample()

    def ours(self) -> set[int]:
        try:
            me = self.psutil.Process(self.root)
            return {self.root, *(p.pid for p in me.children(recursive=True))}
        except self.psutil.Error:
            return {self.root}

    def sample(self) -> tuple[float, dict[str, float]]:
        """(cores used by the others since the previous sample, cores by process name): CPU time over wall time.
        A process first seen now counts whole if it started since the previous sample, else from now on."""
        ours, now, wall_now = self.ours(), time.monotonic(), time.time()
        seen, by_name = {}, {}
        for p in self.psutil.process_iter(["pid", "ppid", "name", "create_time", "cpu_times"]):
            info = p.info
            if info["pid"] in ours or info["ppid"] in (0, 2) or info["cpu_times"] is None:  # kernel threads: ppid 2
                continue
            key = (info["pid"], info["create_time"])
            seen[key] = used = info["cpu_times"].user + info["cpu_times"].system
            before = self.seen.get(key, 0.0 if key[1] >= self.last_wall else used)
            if used > before:
                by_name[info["name"]] = by_name.get(info["name"], 0.0) + used - before
        wall = max(now - self.last, 1e-3)
        self.seen, self.last, self.last_wall = seen, now, wall_now
        return sum(by_name.values()) / wall, {k: v / wall for k, v in by_name.items()}


def busy_line(cores: float, by_name: dict[str, float]) -> str:
    top = [kv for kv in sorted(by_name.items(), key=lambda kv: -kv[1])[:3] if kv[1] >= 0.01]
    who = ", ".join(f"{name} {c:.0%} of a core" for name, c in top)
    return f"other processes use {cores:.2f} cores ({who}); 1-minute load average {os.getloadavg()[0]:.2f}"


def check_quiet(seconds: float = SAMPLE_BEFORE) -> str | None:
    """None when the others used under BUSY_CORES over `seconds`, else a line saying who did."""
    sampler = Sampler()
    time.sleep(seconds)
    cores, by_name = sampler.sample()
    return busy_line(cores, by_name) if cores > BUSY_CORES else None


class Watch:
    """Samples the others every PERIOD seconds in a daemon thread for as long as the benchmark runs."""

    def __init__(self, allowed_loaded: bool, period: float = PERIOD):
        self.allowed_loaded, self.period, self.samples, self.names = allowed_loaded, period, [], {}
        self.load_at_start = os.getloadavg()[0]
        self.sampler, self.lock = Sampler(), threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self.run, daemon=True, name="host-load").start()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.take()

    def take(self) -> None:
        with self.lock:
            cores, by_name = self.sampler.sample()
            self.samples.append(cores)
            for name, c in by_name.items():
                self.names[name] = max(self.names.get(name, 0.0), c)

    def summary(self) -> dict:
        """What the report records: the samples so far (the time since the last one taken now, when a second or
        more), whether they make it a loaded host's, and the busiest others."""
        if time.monotonic() - self.sampler.last >= 1.0:
            self.take()
        n, busy = len(self.samples), sum(c > BUSY_CORES for c in self.samples)
        top = sorted(self.names.items(), key=lambda kv: -kv[1])[:3]
        return {
            "loaded": n > 0 and busy / n >= LOADED_SHARE,
            "samples": n,
            "busy_samples": busy,
            "others_cores_mean": sum(self.samples) / n if n else 0.0,
            "others_cores_max": max(self.samples, default=0.0),
            "top_others": {name: round(c, 2) for name, c in top},
            "load_average_1m_at_start": self.load_at_start,
            "load_average_1m_now": os.getloadavg()[0],
            "allowed_loaded": self.allowed_loaded,
        }


WATCH: list[Watch] = []  # the running benchmark's (tools/benchmark.py starts it); none in a test's in-process call


def start(allowed_loaded: bool) -> None:
    WATCH[:] = [Watch(allowed_loaded)]


def stop() -> None:
    """Stop sampling (a test's in-process benchmark; a benchmark's own process just exits)."""
    if WATCH:
        WATCH.pop().stop.set()


def summary() -> dict | None:
    return WATCH[0].summary() if WATCH else None


def footer_line(host: dict | None) -> str | None:
    """The report's line about the rest of the host while it ran (None in reports without a record)."""
    if not host:
        return None
    seen = (
        f"other processes used {host['others_cores_mean']:.2f} cores on average, at most {host['others_cores_max']:.2f} "
        f"({host['busy_samples']} of {host['samples']} {PERIOD:g}-second samples over {BUSY_CORES} cores"
    )
    top = ", ".join(f"{k} {v:.2f}" for k, v in host["top_others"].items())
    seen += f"; busiest: {top})" if top and host["busy_samples"] else ")"
    if host["loaded"]:
        return (
            f"- **Loaded host: the timings are not quiet-host figures.** {seen[0].upper()}{seen[1:]}; "
            f"1-minute load average {host['load_average_1m_at_start']:.2f} at the start."
        )
    return f"- Quiet host: {seen}; 1-minute load average {host['load_average_1m_at_start']:.2f} at the start."
