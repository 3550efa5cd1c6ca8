"""FLOPs, MFU and the metrics log. The one place that does this arithmetic (train.py and tools/ use it).

Model FLOPs per token follow PaLM (arXiv 2204.02311, appendix B): 6·N for the weight matmuls of
forward + backward, where N counts the parameters that take part in a matmul (the input embedding is a
lookup and costs none; a tied lm_head counts once), plus 12·L·d_attn·s for the attention scores and the
weighted sum. Recomputation for gradient checkpointing is not model FLOPs, by MFU's definition.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from zero_recipes.checkpointing import atomic, storage
from zero_recipes.modeling import moe

# Dense (not 2:4 sparse) peak, FLOP/s per device, from NVIDIA's and AMD's datasheets. NVIDIA's headline
# figures are sparse; using them halves MFU (nanoGPT PR #464 reported "104 % MFU" from the wrong table).
# "tf32" is fp32 through the tensor cores (--tf32, torch.backends.fp32_precision = "tf32"); "fp32" is plain
# fp32, torch's default for matmuls, 7x slower on a Hopper. The PCIe and NVL cards run lower clocks and power than
# the SXM ones of the same name, so they come first: the first name found in the device's name wins.
PEAK_FLOPS = {
    # name substring: {dtype: flop/s}
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM ("H100 80GB HBM3")
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},  # SXM and PCIe alike
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},  # no bf16 or TF32 tensor cores
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "tf32": 653.7e12, "fp32": 163.4e12},
}


def peak_flops_from_table(device_name: str, dtype: str) -> Optional[float]:
    for key, table in PEAK_FLOPS.items():
        if key.lower() in device_name.lower():
            return table.get(dtype)
    return None


def fp32_matmul_kind() -> str:
    """ "tf32" when fp32 matmuls run on the tensor cores (--tf32 true, or the user's own setting), else "fp32"
    (torch >= 2.9's setting, as train.py's --tf32 writes it; the GPU image has 2.11)."""
    import torch

    return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"


def trainable_matmul_params(module) -> Optional[int]:
    """Parameters that get weight gradients, when some are frozen (LoRA): None when all train. ZeRO-3's
    partitioned parameters count whole (ds_numel)."""
    params = {id(p): p for p in module.parameters()}.values()
    if all(p.requires_grad for p in params):
        return None
    return sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)


def model_flops_per_token(config, seq_len: int, trainable: Optional[int] = None) -> float:
    """Training FLOPs (forward + backward) per token for an HF decoder config, without recomputation. A
    mixture of experts counts what a token multiplies by (moe.mlp_params: its k experts, the router and the
    shared experts), not every expert's weights. With `trainable` (LoRA's adapters, the rest frozen) a frozen
    weight costs 4 FLOPs a token (forward, and the backward's input gradient), not 6: it gets no weight
    gradient. The adapters' own 6 each are added."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = text.hidden_size
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    inter = getattr(text, "intermediate_size", None) or 4 * h
    vocab = text.vocab_size
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn = h * q_out + 2 * h * kv_out + q_out * h  # q, k, v, o projections
    gated = getattr(text, "hidden_act", "gelu") in ("silu", "swiglu") or getattr(text, "model_type", "") in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "phi3",
        "mixtral",
    )
    mlp = (3 if gated else 2) * h * inter
    mlp_total = moe.mlp_params(config).active if moe.is_moe(config) else layers * mlp
    matmul_params = layers * attn + mlp_total + h * vocab  # + lm_head
    weights = 6 * matmul_params if trainable is None else 4 * matmul_params + 6 * trainable
    return weights + 12 * layers * q_out * seq_len


def measure_matmul_peak(dtype_name: str = "fp32", seconds: float = 0.5, device: str = "cpu") -> float:
    """Measured matmul FLOP/s, for devices with no trustworthy datasheet figure: every CPU (per rank,
    with this process's threads; all ranks measure at once, so contention is included) and GPUs missing
    from PEAK_FLOPS."""
    import torch

    dtype = {
        "fp32": torch.float32,
        "tf32": torch.float32,  # as torch.backends.fp32_precision has it
        "bf16": torch.bfloat16,
        "fp16": torch.float16 if device != "cpu" else torch.float32,
    }[dtype_name]
    n = 1024 if device == "cpu" else 8192
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    torch.mm(a, b)
    sync()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        iters += 1
        if iters % 8 == 0:
            sync()
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def device_peak_flops(dtype_name: str, cache: Path | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from). A measured peak is kept in `cache` (a JSON
    file) under the device, dtype, threads, ranks on the node and torch version it was measured with, and read
    back by later runs: the measurement holds the first step back half a second on every CPU launch otherwise,
    and the device does not change between runs (the figure only sets the MFU's scale)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        dtype_name = fp32_matmul_kind() if dtype_name == "fp32" else dtype_name
        peak = peak_flops_from_table(name, dtype_name)
        if peak:
            return peak, f"{name} datasheet dense {dtype_name}"
        device, source = "cuda", f"{name} not in the peak table: measured {dtype_name} matmul"
    else:
        name, device = cpu_name(), "cpu"
        source = f"measured {dtype_name} matmul, {torch.get_num_threads()} threads"
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    key = f"{name} | {dtype_name} | {torch.get_num_threads()} threads | {ranks} ranks | torch {torch.__version__}"
    known = _read_json(cache) if cache else {}
    if key in known:
        return known[key]["flops"], f"{source} on {known[key]['date']}"
    peak = measure_matmul_peak(dtype_name, device=device)
    if cache:
        _write_json(cache, {**known, key: {"flops": peak, "date": time.strftime("%Y-%m-%d")}})
    return peak, source


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; only without it platform's, which runs `uname -p` on Linux)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure again and rewrite it


def _write_json(path: Path, value: dict) -> None:
    """Atomic (ranks measure and write at once); a read-only cache costs the next run the measurement, no more."""
    try:
        atomic.write_text(path, json.dumps(value, indent=1))
    except OSError:
        pass


def mfu(tokens_per_sec_per_device: float, flops_per_token: float, peak: float) -> float:
    return tokens_per_sec_per_device * flops_per_token / peak


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
        self.tokens_per_step_rank, self.losses_per_step = tokens_per_step_rank, losses_per_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        # `tokens_per_step_rank` counts a data-parallel replica's rows; `group` ranks train them together (a TP
        # or SP group): count them once. Under SP each rank's loss is its slice's share (`loss_shares` = SP size).
        self.group, self.loss_shares = group, loss_shares
        self._restart()

    def _restart(self) -> None:
        self.steps, self.data_wait, self.start = 0, 0.0, time.perf_counter()

    def add_loss(self, loss) -> None:
        self.loss_sum += loss.detach()

    def add_aux(self, aux) -> None:
        self.aux_sum[0] += aux.float()
        self.aux_sum[1] += 1
        self.has_aux = True

    def add_step(self, data_wait: float) -> None:
        self.steps += 1
        self.data_wait += data_wait

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
        world = dist.get_world_size()
        loss = self.loss_sum.item() * self.loss_shares / (self.steps * self.losses_per_step * world)
        elapsed = time.perf_counter() - self.start
        tps = self.tokens_per_step_rank * self.steps / elapsed / self.group  # each device's share of its group's
        out = {
            "loss": loss,
            "tokens_per_sec": tps * world,
            "tokens_per_sec_per_device": tps,
            "mfu": mfu(tps, self.flops_per_token, self.peak_flops),
            "data_wait_frac": self.data_wait / elapsed,
        }
        if aux is not None:
            out["aux_loss"] = aux
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
