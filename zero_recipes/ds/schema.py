"""What the installed DeepSpeed accepts, asked of DeepSpeed itself.

`deepspeed.initialize` validates its config with pydantic models (`DeepSpeedZeroConfig`, `DeepSpeedBF16Config`,
...) only once the process group is up and the model is built, and it reports a mistake as a multi-line
traceback on every rank. Here the same models run once, before any of that, and each rejection becomes one line.

- `normalise`: every spelling DeepSpeed accepts for a key (field name, alias, deprecated name with a replacement,
  `bfloat16` for `bf16`) becomes one canonical spelling, the one DeepSpeed's docs use (the alias where a field
  has one: `stage3_max_live_parameters`). The table is read from the models' fields, so a DeepSpeed upgrade
  brings its own; nothing here lists key names by hand.
- `validate`: the same models, then `DeepSpeedConfig` itself for its cross-field checks.

What DeepSpeed accepts and then ignores, and what this machine cannot run, are ds/checks.py's.
"""

from __future__ import annotations

import copy
import difflib
import logging
import typing
from dataclasses import dataclass, field
from typing import Callable, Optional

from zero_recipes.errors import ConfigError


def block_models() -> dict[str, type]:
    """The top-level blocks DeepSpeed 0.19.8 reads through a pydantic model, by key (runtime/config.py,
    `DeepSpeedConfig._initialize_params`). Which key feeds which model is DeepSpeed's wiring, not exposed as data."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "tensor_parallel": TPTrainingConfig,
        "compile": CompileConfig,
        "comms_logger": CommsLoggerConfig,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
        "comet": CometConfig,
        "hybrid_engine": HybridEngineConfig,
    }


@dataclass
class Names:
    """Every spelling a model accepts, mapped to its canonical one."""

    canonical: dict[str, str] = field(default_factory=dict)
    convert: dict[str, Callable] = field(default_factory=dict)
    """Deprecated spelling -> DeepSpeed's own function from its value to the replacement's (`new_param_fn`)."""
    nested: dict[str, type] = field(default_factory=dict)
    """Canonical key -> the model of its sub-block (offload_param, offload_optimizer, ...)."""


def names_of(model: type) -> Names:
    out = Names()
    for name, f in model.model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            # DeepSpeedConfigModel's deprecated fields name their replacement in `new_param`; the ones that
            # replace nothing ("offload_param or offload_optimizer", set_new_param False) stay DeepSpeed's business.
            target = model.model_fields.get(extra.get("new_param", ""))
            if target is not None and extra.get("set_new_param", True):
                out.canonical[name] = target.alias or extra["new_param"]
                if extra.get("new_param_fn"):
                    out.convert[name] = extra["new_param_fn"]
            continue
        canonical = f.alias or name
        out.canonical[name] = canonical
        out.canonical[canonical] = canonical
        sub = _model_in(f.annotation)
        if sub is not None:
            out.nested[canonical] = sub
    return out


def _model_in(annotation) -> Optional[type]:
    """The pydantic model in `X` or `Optional[X]`, if any."""
    from pydantic import BaseModel

    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def normalise(raw: dict, models: Optional[dict[str, type]] = None) -> tuple[dict, list[str]]:
    """(config with every key in its canonical spelling, a note per key renamed). Two spellings of one key
    with different values are an error; with the same value, one is dropped."""
    from deepspeed.runtime.precision_config import BFLOAT16, BFLOAT16_OLD

    models = block_models() if models is None else models
    notes: list[str] = []
    top = copy.deepcopy(raw)
    if BFLOAT16_OLD in top:  # DeepSpeed reads "bfloat16" only where "bf16" is absent (get_bfloat16_config)
        if BFLOAT16 in top and top[BFLOAT16] != top[BFLOAT16_OLD]:
            raise ConfigError(
                f'the DeepSpeed config has both "{BFLOAT16}" and its old name "{BFLOAT16_OLD}", with different '
                f'values; keep only "{BFLOAT16}"'
            )
        if BFLOAT16 in top:
            del top[BFLOAT16_OLD]
            notes.append(f'dropped "{BFLOAT16_OLD}": it repeats "{BFLOAT16}"')
        else:  # renamed in place, so the file's order survives into --dry_run's printout
            top = {BFLOAT16 if k == BFLOAT16_OLD else k: v for k, v in top.items()}
            notes.append(f'renamed "{BFLOAT16_OLD}" to "{BFLOAT16}" (DeepSpeed\'s current name for the block)')
    if isinstance(top.get("zero_optimization"), bool):  # the pre-0.3 form DeepSpeed still reads as stage 0/1
        top["zero_optimization"] = {"stage": int(top["zero_optimization"])}
        notes.append(
            f'read "zero_optimization": {str(raw["zero_optimization"]).lower()} as stage {int(raw["zero_optimization"])}'
        )
    for key, model in models.items():
        if isinstance(top.get(key), dict):
            top[key] = _normalise_block(top[key], model, key, notes)
    return top, notes


def _normalise_block(block: dict, model: type, path: str, notes: list[str]) -> dict:
    from pydantic import BaseModel

    names = names_of(model)
    out: dict = {}
    spelled: dict[str, str] = {}
    for key, value in block.items():
        canonical = names.canonical.get(key, key)  # an unknown key is left for `validate` to name
        if key in names.convert:
            value = names.convert[key](value)
            if isinstance(value, BaseModel):
                value = value.model_dump(mode="json", exclude_unset=True)
            if value is None:
                notes.append(f"dropped {path}.{key} = {block[key]!r} (deprecated; it asks for nothing)")
                continue
        if canonical in names.nested and isinstance(value, dict):
            value = _normalise_block(value, names.nested[canonical], f"{path}.{canonical}", notes)
        if canonical in out:
            if out[canonical] != value:
                raise ConfigError(
                    f"the DeepSpeed config sets {path}.{spelled[canonical]} = {out[canonical]!r} and "
                    f"{path}.{key} = {value!r}, two names for one DeepSpeed setting; keep one"
                )
            notes.append(f"dropped {path}.{key}: it repeats {path}.{spelled[canonical]}")
            continue
        if canonical != key:
            notes.append(f"renamed {path}.{key} to {path}.{canonical}")
        out[canonical] = value
        spelled[canonical] = key
    return out


# ---- validation ---------------------------------------------------------------------------------------------


def validate(ds: dict, sized_by_auto: frozenset[str] = frozenset()) -> None:
    """Run DeepSpeed's own config models over a resolved config; raise one line naming every rejection.
    `sized_by_auto`: key paths that accept "auto" here, so the fix can say so."""
    import deepspeed
    from pydantic import ValidationError

    problems = []
    for key, model in block_models().items():
        if key not in ds:
            continue
        if not isinstance(ds[key], dict):
            problems.append(f'{key} = {ds[key]!r} must be an object {{...}} (see "{key}" in ds_configs/)')
            continue
        try:
            model(**ds[key])
        except ValidationError as e:
            problems += [describe(err, key, model, sized_by_auto) for err in e.errors()]
    if not problems:
        problems = _whole_config_problems(ds)
    if problems:
        raise ConfigError(f"DeepSpeed config (checked by DeepSpeed {deepspeed.__version__}): " + "; ".join(problems))


def _whole_config_problems(ds: dict) -> list[str]:
    """DeepSpeedConfig's cross-field checks (batch, stage, removed features). train_batch_size depends on the
    world size, which a single process does not have; ds_config checked that arithmetic already."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    whole = copy.deepcopy(ds)
    whole.pop("train_batch_size", None)
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its per-construction INFO lines are not for the user
    try:
        DeepSpeedConfig(whole)
    except ValidationError as e:
        return [describe(err, "", None, frozenset()) for err in e.errors()]
    except Exception as e:  # noqa: BLE001 -- its asserts, ValueErrors and DeepSpeedConfigError (removed features): their text is the line
        text = str(e).strip()
        return [text.splitlines()[0] if text else type(e).__name__]
    finally:
        quiet.setLevel(level)
    return []


_ACCEPTS = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "enum": "must be one of {expected}",
    "literal_error": "must be one of {expected}",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "dict_type": "must be an object {{...}}",
    "model_type": "must be an object {{...}}",
    "model_attributes_type": "must be an object {{...}}",
}


def describe(err: dict, block: str, model: Optional[type], sized_by_auto: frozenset[str]) -> str:
    """One pydantic error as `path = value <what is accepted> (<fix>)`."""
    loc = [str(x) for x in err.get("loc", ())]
    path = ".".join([block, *loc] if block else loc) or block
    value = err.get("input")
    kind = err.get("type", "")
    ctx = {k: _tidy(v) for k, v in (err.get("ctx") or {}).items()}
    if kind == "extra_forbidden":
        known = _spellings_at(model, loc[:-1]) if model is not None else []
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.75)
        home = [
            k for k, m in block_models().items() if k != block and not loc[:-1] and loc[-1] in names_of(m).canonical
        ]
        if close:
            fix = f"did you mean '{close[0]}'?"
        elif home:
            fix = f"it is a {home[0]} setting; remove it here"
        else:
            fix = "remove it"
        return f"{path} is not a key DeepSpeed reads there ({fix})"
    accepts = (
        _ACCEPTS[kind].format(**ctx)
        if kind in _ACCEPTS
        else err.get("msg", "").removeprefix("Value error, ").removeprefix("Assertion failed, ")
    )
    if kind.startswith(("greater", "less")):
        fix = 'set a size, or "auto"' if path in sized_by_auto else "change the value"
    elif kind in ("enum", "literal_error"):
        fix = "use one of those"
    else:
        fix = "fix the value"
    return f"{path} = {value!r} {accepts} ({fix})"


def _tidy(v):
    """pydantic's enum text for ZeroStageEnum repeats max_stage: '0, 1, 2, 3 or 3'."""
    if isinstance(v, str) and " or " in v:
        parts = [p.strip() for p in v.replace(" or ", ", ").split(",")]
        parts = list(dict.fromkeys(parts))
        return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]
    return v


def _spellings_at(model: type, loc: list[str]) -> list[str]:
    for key in loc:
        names = names_of(model)
        model = names.nested.get(names.canonical.get(key, key))
        if model is None:
            return []
    return sorted(names_of(model).canonical)
