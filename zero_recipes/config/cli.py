"""Reading a run's options into the typed schema (config.TrainConfig): a YAML recipe first, then
`--key value` flags, each value coerced to its field's type with an error that names the field; and
`--help`, printed from the schema's own field docstrings.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

import yaml

from zero_recipes.config import lora_options, lr_defaults
from zero_recipes.config.train_config import FIELDS, REPO_ROOT, TrainConfig, resolve_path, validate
from zero_recipes.distributed.launcher_env import accelerate_launch_choices
from zero_recipes.errors import ConfigError


def field_docs() -> dict[str, str]:
    """Field docstrings, read from the source so `--help` shows the schema's own words."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    docs, last = {}, None
    for node in tree.body[0].body:
        if isinstance(node, ast.AnnAssign):
            last = node.target.id
        elif last and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[last] = " ".join(str(node.value.value).split())
            last = None
    return docs


def _base_type(tp):
    """Optional[int] -> int; list/dict stay."""
    tp = eval(tp, vars(typing)) if isinstance(tp, str) else tp
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "y", "on"):
        return True
    if text in ("false", "0", "no", "n", "off"):
        return False
    raise ConfigError(f"--{name} expects true or false, got {value!r}")


def coerce(name: str, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's type, with an error naming the field."""
    tp = _base_type(FIELDS[name].type)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and tp is not str):
        return None
    try:
        if tp is bool:
            return parse_bool(name, value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if tp is list:
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    except (TypeError, ValueError):
        raise ConfigError(f"--{name} expects {tp.__name__}, got {value!r}") from None
    return value


def unknown_key_error(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see `python train.py --help` for the options"
    return ConfigError(f"unknown option '{key}' in {where}{hint}")


def load_recipe(path: str) -> dict:
    p = resolve_path(path)
    if not p.is_file():
        recipes = sorted(x.name for x in (REPO_ROOT / "recipes").glob("*.yaml"))
        raise ConfigError(f"recipe '{path}' not found; shipped recipes: {', '.join(recipes)}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"recipe {path}{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of option: value, got {type(data).__name__}")
    return data


def split_argv(argv: list[str]) -> list[tuple[str, list[str]]]:
    """['--a', '1', '--flag', '--b=2', '--deepspeed', 'x.json', 'y.json'] -> [(a,[1]), (flag,[]), ...]"""
    items: list[tuple[str, list[str]]] = []
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            key, eq, val = tok[2:].partition("=")
            items.append((key.replace("-", "_"), [val] if eq else []))
        elif items:
            items[-1][1].append(tok)
        else:
            raise ConfigError(f"unexpected argument '{tok}'; options look like --key value")
    return items


def parse_args(argv: list[str]) -> tuple[TrainConfig, set[str]]:
    """Build the config from argv. Returns it and the names of the fields the user set explicitly."""
    items = split_argv(argv)
    values: dict[str, Any] = {}
    recipe = [v for k, v in items if k == "recipe"]
    if recipe:
        if len(recipe[-1]) != 1:
            raise ConfigError("--recipe takes one YAML file, e.g. --recipe recipes/tiny-llama.yaml")
        path = recipe[-1][0]
        for key, value in lora_options.flatten_recipe_block(load_recipe(path), path).items():
            if key not in FIELDS:
                raise unknown_key_error(key, f"recipe {path}")
            values[key] = coerce(key, value)
    for key, vals in items:
        if key == "recipe":
            continue
        if key not in FIELDS:
            raise unknown_key_error(key, "the command line")
        tp = _base_type(FIELDS[key].type)
        if tp is list:
            if not vals:
                raise ConfigError(f"--{key} needs at least one value")
            values[key] = vals
        elif tp is bool and not vals:
            values[key] = True
        elif len(vals) != 1:
            raise ConfigError(f"--{key} takes one value, got {len(vals)}: {' '.join(vals) or '(none)'}")
        else:
            values[key] = coerce(key, vals[0])
    values.update(accelerate_launch_choices(values))  # accelerate launch's DeepSpeed JSON and precision
    explicit = set(values) - {"local_rank"}
    cfg = lr_defaults.apply(TrainConfig(**values), explicit)  # what is trained decides what was left unset
    validate(cfg)
    return cfg, explicit


def help_text() -> str:
    docs = field_docs()
    lines = [
        "usage: deepspeed train.py --deepspeed ds_configs/zero3.json [--recipe recipes/X.yaml] [--key value ...]",
        "",
        "options (also valid as recipe keys):",
    ]
    for name, f in FIELDS.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        lines.append(f"  --{name} (default: {lr_defaults.help_default(name) or repr(default)})")
        if docs.get(name):
            lines.append(f"      {docs[name]}")
    return "\n".join(lines)
