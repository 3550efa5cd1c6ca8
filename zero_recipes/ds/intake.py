"""DeepSpeed JSON: merge fragments left to right, then fill every "auto" with the HF Trainer's semantics.

Why not `transformers.integrations.HfTrainerDeepSpeedConfig`: it is bound to `TrainingArguments` and
fills values lazily (some only inside `Trainer.train`), which is how "auto"s end up unresolved under
`zero.Init` (axolotl #1850). Here everything is resolved up front, explicit contradictions are errors
naming both values, and an "auto" nobody knows how to fill is an error instead of being dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from zero_recipes import modes
from zero_recipes.config.train_config import REPO_ROOT, TrainConfig, resolve_path
from zero_recipes.ds import checks as ds_checks, gpu_only, precision_blocks, schema as ds_schema
from zero_recipes.ds.facts import precision, precision_words, zero_stage
from zero_recipes.errors import ConfigError
from zero_recipes.parallel.mesh import Mesh

AUTO = "auto"


def load_fragments(paths: list[str]) -> dict:
    merged: dict = {}
    for path in paths:
        p = resolve_path(path)
        if p.is_dir():
            inside = ", ".join(sorted(x.name for x in p.glob("*.json"))) or "no .json files"
            raise ConfigError(f"--deepspeed {path} is a directory ({inside}); give the JSON file(s) to merge")
        if not p.is_file():
            shipped = ", ".join(sorted(x.name for x in (REPO_ROOT / "ds_configs").glob("*.json")))
            raise ConfigError(f"DeepSpeed config '{path}' not found; shipped in ds_configs/: {shipped}")
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise ConfigError(f"DeepSpeed config {path} cannot be read ({e.strerror}); check its permissions") from None
        except UnicodeDecodeError:
            raise ConfigError(f"DeepSpeed config {path} is not text; give a JSON file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a DeepSpeed config must be a JSON object, got {type(data).__name__}")
        merged = deep_merge(merged, data)
    return merged


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@dataclass(frozen=True)
class Resolved:
    """A DeepSpeed config with every "auto" but the scheduler's step counts filled (see `with_steps`)."""

    ds: dict
    cfg: TrainConfig
    """The run's config with the values the DeepSpeed file sets explicitly adopted, where the recipe and
    flags left those fields at their defaults (the notes say which)."""
    notes: tuple[str, ...]


class Resolver:
    """Fills "auto"s and collects contradictions, so the user sees every conflict at once. Adoptions go
    into its own copy of the config (`self.cfg`), never into the caller's."""

    def __init__(self, cfg: TrainConfig, explicit: set[str]):
        self.cfg = dataclasses.replace(cfg)
        self.explicit = explicit
        self.conflicts: list[str] = []
        self.notes: list[str] = []

    def adopt(self, field: str, value: Any, where: str) -> None:
        setattr(self.cfg, field, value)
        self.notes.append(f"adopted {field}={value!r} (from the DeepSpeed config's {where})")

    def match(self, node: dict, key: str, value: Any, field: Optional[str], where: str) -> None:
        """node[key] = value if auto/absent; if explicit and different: adopt it into the recipe when the
        recipe never set that field, else record a conflict naming both values."""
        if key not in node or node[key] == AUTO:
            node[key] = value
            return
        given = node[key]
        if field is None or _same(given, value):
            return
        if field not in self.explicit:
            self.adopt(field, given, where)
            return
        self.conflicts.append(f"{where}={given!r} but {field}={value!r}")


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def resolve(raw: dict, cfg: TrainConfig, explicit: set[str], world_size: int, hidden_size: Optional[int]) -> Resolved:
    """Normalise the key names, fill every "auto" the HF Trainer fills (except the scheduler's step counts,
    which wait for the dataset size: `with_steps`), refuse what DeepSpeed would silently ignore, and validate
    the result with DeepSpeed's own config models. Pure: `cfg` is not changed; the adopted config comes back."""
    ds, renamed = ds_schema.normalise(raw)
    r = Resolver(cfg, explicit)
    r.notes += renamed
    _resolve_precision(ds, r)
    r.notes += modes.adopt(ds)
    mesh = Mesh.of(world_size, ds)
    mesh.check()
    modes.parallelism_for(mesh).configure(ds)
    r.notes += gpu_only.resolve(ds, r)  # ZenFlow, SuperOffload, DeepCompile: before the batch and optimizer fill
    _resolve_batch(ds, r, mesh.dp)
    r.match(ds, "gradient_clipping", r.cfg.max_grad_norm, "max_grad_norm", "gradient_clipping")
    _resolve_optimizer(ds, r)
    sched = ds.get("scheduler")
    if isinstance(sched, dict):
        p = sched.setdefault("params", {})
        r.match(p, "warmup_min_lr", 0, None, "scheduler.params.warmup_min_lr")
        r.match(p, "warmup_max_lr", r.cfg.learning_rate, "learning_rate", "scheduler.params.warmup_max_lr")
    if isinstance(ds.get("zero_optimization"), dict):
        _resolve_zero(ds, ds["zero_optimization"], r, hidden_size)
    if r.conflicts:
        raise ConfigError(
            "the DeepSpeed config contradicts the recipe: "
            + "; ".join(r.conflicts)
            + ' (set those keys to "auto" or change the recipe)'
        )
    r.notes += ds_checks.refuse_ignored(ds)
    ds_schema.validate(ds, SIZED_BY_AUTO)
    return Resolved(ds, r.cfg, tuple(r.notes))


def with_steps(ds: dict, cfg: TrainConfig, total_steps: int) -> dict:
    """A resolved config completed with the run's step count: the scheduler's warmup and total steps.
    Any "auto" still left is one nobody knows how to fill, and an error rather than something dropped."""
    ds = copy.deepcopy(ds)
    sched = ds.get("scheduler")
    if isinstance(sched, dict):
        p = sched.setdefault("params", {})
        for key in ("warmup_num_steps", "total_num_steps"):
            if key == "total_num_steps" and sched.get("type") not in ("WarmupDecayLR", "WarmupCosineLR"):
                continue
            if p.get(key, AUTO) == AUTO:
                p[key] = warmup_steps(cfg, total_steps) if key == "warmup_num_steps" else total_steps
    left = find_auto(ds)
    if left:
        raise ConfigError(
            f"DeepSpeed config key '{left}' is \"auto\" but zero-recipes does not know how to fill it; give it a value"
        )
    return ds


def _resolve_precision(ds: dict, r: Resolver) -> None:
    """A fragment saying enabled=true (bf16.json) turns it on unless the recipe says otherwise."""
    for name in ("bf16", "fp16"):
        block = ds.setdefault(name, {})
        if not isinstance(block, dict):
            raise ConfigError(f'DeepSpeed config \'{name}\' must be an object like {{"enabled": "auto"}}')
        enabled = block.get("enabled", AUTO)
        mine = getattr(r.cfg, name)
        if enabled == AUTO:
            block["enabled"] = bool(mine)
        elif mine is None:
            setattr(r.cfg, name, bool(enabled))
        elif bool(enabled) != bool(mine):
            r.conflicts.append(f"{name}.enabled={enabled!r} but {name}={mine!r}")
    if ds["bf16"]["enabled"] and ds["fp16"]["enabled"]:
        raise ConfigError("bf16 and fp16 are both enabled; use one precision fragment (bf16.json or fp16.json)")
    # low-precision master weights and states, torch_autocast: checked and filled (ds/precision_blocks.py), and
    # the precision in words for --dry_run where "bf16"/"fp32" alone would mislead
    r.notes += precision_blocks.resolve(ds)
    words = precision_words(ds)
    if words != precision(ds):
        r.notes.append(f"precision: {words}")


def _resolve_batch(ds: dict, r: Resolver, dp: int) -> None:
    """As HF: train_batch_size = micro x accumulation x data-parallel size (the world without tensor
    parallelism; with it, the ranks of a TP group share one micro-batch, so they count once)."""
    r.match(
        ds,
        "train_micro_batch_size_per_gpu",
        r.cfg.per_device_train_batch_size,
        "per_device_train_batch_size",
        "train_micro_batch_size_per_gpu",
    )
    r.match(
        ds,
        "gradient_accumulation_steps",
        r.cfg.gradient_accumulation_steps,
        "gradient_accumulation_steps",
        "gradient_accumulation_steps",
    )
    micro, gas = r.cfg.per_device_train_batch_size, r.cfg.gradient_accumulation_steps
    if isinstance(ds["train_micro_batch_size_per_gpu"], int):
        micro = ds["train_micro_batch_size_per_gpu"]
    if isinstance(ds["gradient_accumulation_steps"], int):
        gas = ds["gradient_accumulation_steps"]
    tbs = ds.get("train_batch_size", AUTO)
    if tbs == AUTO:
        ds["train_batch_size"] = micro * gas * dp
    elif tbs != micro * gas * dp:
        raise ConfigError(
            f"batch sizes do not add up: train_batch_size={tbs} but micro {micro} x accumulation "
            f'{gas} x data-parallel {dp} = {micro * gas * dp}; set train_batch_size to "auto"'
        )


# What each DeepSpeed optimizer type takes of the recipe's AdamW settings, so a key it has no argument for is
# never added: DeepSpeedCPULion has no eps (a Lion block given one stops in deepspeed.initialize with a
# TypeError). Types not listed (torch.optim's SGD, RMSprop, ...) get lr and weight_decay alone; the HF Trainer
# fills only keys a file writes, which leaves a Lion block's eps out the same way.
_ADAM_KEYS = ("lr", "weight_decay", "eps", "betas")
OPTIMIZER_KEYS = {name: _ADAM_KEYS for name in ("adam", "adamw", "lamb", "muon", "adamax", "nadam", "radam")}
OPTIMIZER_KEYS |= {"lion": ("lr", "weight_decay", "betas"), "adagrad": ("lr", "weight_decay", "eps")}


def _resolve_optimizer(ds: dict, r: Resolver) -> None:
    opt = ds.get("optimizer")
    if not isinstance(opt, dict):
        return
    p = opt.setdefault("params", {})
    name = str(opt.get("type", "")).lower()
    takes = OPTIMIZER_KEYS.get(name, ("lr", "weight_decay"))
    for key in [k for k in ("eps", "betas") if k not in takes]:
        if p.get(key) == AUTO:
            raise ConfigError(f'optimizer.params.{key} is "auto" but {opt["type"]} takes no {key}; delete the key')
    r.match(p, "lr", r.cfg.learning_rate, "learning_rate", "optimizer.params.lr")
    r.match(p, "weight_decay", r.cfg.weight_decay, "weight_decay", "optimizer.params.weight_decay")
    if "eps" in takes:
        r.match(p, "eps", r.cfg.adam_epsilon, "adam_epsilon", "optimizer.params.eps")
    if "betas" in takes:
        _resolve_betas(p, r)
    if name == "muon":
        r.notes += _resolve_muon(ds, p, r.cfg.learning_rate)


def _resolve_betas(p: dict, r: Resolver) -> None:
    if p.get("betas", AUTO) == AUTO:
        p["betas"] = [r.cfg.adam_beta1, r.cfg.adam_beta2]
        return
    r.match(p, "betas", [r.cfg.adam_beta1, r.cfg.adam_beta2], None, "optimizer.params.betas")
    b = p["betas"]
    for i, name in enumerate(("adam_beta1", "adam_beta2")):
        r.match({"b": b[i]}, "b", getattr(r.cfg, name), name, f"optimizer.params.betas[{i}]")


def _resolve_muon(ds: dict, p: dict, learning_rate: float) -> list[str]:
    """DeepSpeed's Muon (ds_configs/muon.json): 2-D non-embedding parameters take Muon, the rest AdamW. `adam_lr`
    and `muon_lr` "auto" are the recipe's learning_rate, as `lr` is (DeepSpeed's own value for an absent key);
    muon.json sets `muon_lr` itself (docs: Muon's usual rate is about 0.02). Clipping at ZeRO-1/2/3 is refused:
    DeepSpeed clips the orthogonalized update there (docs/dev/deepspeed-bugs.md#muon). ZeRO-3 refuses Muon with
    `reduce_scatter` on (stage3.py: "Muon and reduce scatter cannot be used together"), which defaults to true:
    left unset it is set false with a note; set true, the config is refused in one line naming the fix."""
    for key in ("adam_lr", "muon_lr"):
        if p.get(key) == AUTO:
            p[key] = learning_rate
    stage, clipping = zero_stage(ds), ds.get("gradient_clipping") or 0
    if stage and clipping:
        raise ConfigError(
            f"gradient_clipping {clipping:g} with the Muon optimizer at ZeRO-{stage}: DeepSpeed 0.19.8 clips Muon's "
            "orthogonalized updates instead of the gradients (deepspeed#8439), dividing every Muon step by the norm of "
            "all of them; set gradient_clipping 0 (--max_grad_norm 0), as ds_configs/muon.json does"
        )
    if stage != 3:
        return []
    z = ds["zero_optimization"]
    given = z.get("reduce_scatter", AUTO)
    if given not in (AUTO, False):
        raise ConfigError(
            f"zero_optimization.reduce_scatter={given!r} with the Muon optimizer at ZeRO-3: DeepSpeed refuses the "
            'pair ("Muon and reduce scatter cannot be used together"); set "reduce_scatter": false, or leave it '
            "out and train.py sets it"
        )
    z["reduce_scatter"] = False
    if given == AUTO:
        return [
            "zero_optimization.reduce_scatter=false: DeepSpeed's ZeRO-3 runs Muon only without reduce-scatter "
            "(each gradient bucket is all-reduced, and each Muon matrix gathered whole once a step)"
        ]
    return []


# zero_optimization keys whose "auto" is sized from the model's hidden size h, as the HF Trainer does.
# Keys are in ds_schema's canonical spelling (names are normalised before resolution).
ZERO_AUTO_SIZES = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
SIZED_BY_AUTO = frozenset(f"zero_optimization.{k}" for k in ZERO_AUTO_SIZES)


def _resolve_zero(ds: dict, z: dict, r: Resolver, hidden_size: Optional[int]) -> None:
    autos = [k for k in ZERO_AUTO_SIZES if z.get(k) == AUTO]
    if autos and not hidden_size:
        raise ConfigError(
            f"zero_optimization {', '.join(autos)} are 'auto' but the model config has no "
            "hidden_size; give them numeric values"
        )
    for key in autos:
        z[key] = ZERO_AUTO_SIZES[key](hidden_size)
    for key in ("offload_optimizer", "offload_param"):
        block = z.get(key)
        if isinstance(block, dict) and block.get("nvme_path") == AUTO:
            if block.get("device") != "nvme":
                del block["nvme_path"]
            elif not r.cfg.nvme_path:
                raise ConfigError(
                    'the DeepSpeed config offloads to NVMe with nvme_path "auto"; give --nvme_path /local/nvme/dir'
                )
            else:
                block["nvme_path"] = r.cfg.nvme_path  # whether it exists is ds_schema.machine_problems' question
    if zero_stage(ds) == 3:
        # Export gathers 16-bit weights itself (export.export_hf_model); this keeps DeepSpeed's own
        # `save_16bit_model` usable too, as HF configs expect. Safe: the names were normalised, so a file
        # spelling it `gather_16bit_weights_on_model_save` now has this key, and setdefault keeps its value.
        z.setdefault("stage3_gather_16bit_weights_on_model_save", True)


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """HF semantics: warmup_steps wins when > 0, else ceil(warmup_ratio x total)."""
    import math

    return cfg.warmup_steps if cfg.warmup_steps > 0 else math.ceil(cfg.warmup_ratio * total_steps)


def find_auto(node, prefix="") -> Optional[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            hit = find_auto(v, f"{prefix}.{k}" if prefix else k)
            if hit:
                return hit
    elif isinstance(node, list):
        for i, v in enumerate(node):
            hit = find_auto(v, f"{prefix}[{i}]")
            if hit:
                return hit
    elif node == AUTO:
        return prefix
    return None
