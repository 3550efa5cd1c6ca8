"""EleutherAI's lm-evaluation-harness, called as its own CLI calls it (`lm_eval.simple_evaluate` with a
`TaskManager` over the shipped eval_tasks/ and the user's YAMLs), so its numbers are lm-eval's: the command
`cli_command` prints gives the same values. This module adds only what lm-eval leaves to the caller: task
names and YAMLs checked before a model loads (unknown names with close ones, the key a YAML lacks), a run's
export read as a model or a PEFT adapter with the run's own tokenizer, and the results as a table and as
flat metrics for metrics.jsonl.

Offline: set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 (lm-eval#1877); the shipped tasks read local files.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from .shipped_tasks import TASKS_DIR

CHAT_TEMPLATE_MODES = ("auto", "on", "off")


@dataclass
class TaskSelection:
    """What `lm_eval --tasks NAMES --include_path DIRS` would be given."""

    names: list[str]
    include: list[str] = field(default_factory=lambda: [str(TASKS_DIR)])
    defaults: bool = False
    """Whether a name is one of lm-eval's own tasks (its whole index is then needed)."""


def quiet() -> None:
    """lm-eval logs every request batch and task config at INFO; a run's log keeps its warnings."""
    for name in ("lm_eval", "lm-eval", "datasets", "evaluate"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # its warning that a model object means one process: train.py's ranks each run the same requests on purpose
    logging.getLogger("lm_eval.models.huggingface").setLevel(logging.ERROR)
    # the hint, for every task with a `custom_dataset` loader (the shipped ones), that it may take --metadata
    # kwargs, and the note that gen_kwargs update the tasks' (in training: synced_gpus, nothing a task sets)
    for name in ("lm_eval.api.task", "lm_eval.evaluator"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _Hush) for f in log.filters):
            log.addFilter(_Hush())


class _Hush(logging.Filter):
    HINTS = ("Custom kwargs can be passed to `--metadata`", "specified through cli, these settings will update")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(hint in record.getMessage() for hint in self.HINTS)


@functools.lru_cache(maxsize=4)
def task_manager(include: tuple[str, ...], defaults: bool = True):
    """lm-eval's index of the tasks in `include`, and of every task it ships when `defaults` (about 15 s to
    build on 2 cores, so built once and only when a name needs it)."""
    quiet()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include), include_defaults=defaults, verbosity="WARNING")


REQUIRED_KEYS = ("task", "output_type", "doc_to_text", "doc_to_target")


def read_task_yaml(path: Path) -> dict:
    """A task YAML as lm-eval reads it (its loader knows `!function`), checked for the keys a task needs."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if not path.is_file():
        raise ConfigError(f"task file {path} does not exist")
    try:
        config = load_yaml(str(path), resolve_func=False)
    except Exception as e:  # yaml.YAMLError, a constructor lm-eval does not know, or not a mapping
        if "Expected YAML dict" in str(e):
            raise ConfigError(f"task file {path} is not a YAML mapping of lm-eval task keys") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"task file {path} does not parse as YAML: {first}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"task file {path} is not a YAML mapping of lm-eval task keys")
    if "include" in config or "group" in config or "task" in config and isinstance(config["task"], list):
        return config  # a group or a file that includes another: lm-eval resolves and checks it
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if "dataset_path" not in config and "custom_dataset" not in config:
        missing.append("dataset_path")
    if config.get("output_type") == "multiple_choice" and "doc_to_choice" not in config:
        missing.append("doc_to_choice")
    if missing:
        raise ConfigError(
            f"task file {path} lacks the key {missing[0]!r} (needs {', '.join(REQUIRED_KEYS)}, dataset_path or "
            "custom_dataset, and doc_to_choice for multiple_choice; see lm-eval's docs/new_task_guide.md)"
        )
    return config


def select_tasks(requested: list[str]) -> TaskSelection:
    """Names (lm-eval's own, or the shipped ones) and YAML files, each checked; a YAML's directory joins the
    include path (so its `!function` helpers and includes resolve) and its `task:` name is what runs."""
    selection = TaskSelection([])
    names = []
    for item in (t.strip() for entry in requested for t in entry.split(",")):
        if not item:
            continue
        if item.endswith((".yaml", ".yml")):
            path = Path(item).resolve()
            config = read_task_yaml(path)
            if str(path.parent) not in selection.include:
                selection.include.append(str(path.parent))
            selection.names.append(str(config.get("task") or config.get("group")))
        else:
            names.append(item)
    if not selection.names and not names:
        raise ConfigError("no task given; name one, e.g. --tasks docstring_cloze (shipped in eval_tasks/)")
    local = task_manager(tuple(selection.include), False)
    if any(not local.match_tasks([name]) for name in names):
        selection.defaults = True
        known = task_manager(tuple(selection.include), True)
        for name in names:
            if not known.match_tasks([name]):
                close = difflib.get_close_matches(name, known.all_tasks, n=3, cutoff=0.6)
                hint = f"; close names: {', '.join(close)}" if close else ""
                raise ConfigError(
                    f"lm-eval does not know the task {name!r}{hint} (`lm_eval ls tasks` lists them; a YAML "
                    "file's path works too)"
                )
    selection.names = names + selection.names
    return selection


def model_args(model_dir: Path) -> dict:
    """lm-eval's `hf` model arguments for a run's export: a full model, or a PEFT adapter on the base its
    adapter_config.json names. The tokenizer is the one the run saved (its chat template included)."""
    from zero_recipes.adapters.lora import is_adapter_dir

    if is_adapter_dir(model_dir):
        base = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        return {"pretrained": base, "peft": str(model_dir), "tokenizer": str(model_dir)}
    return {"pretrained": str(model_dir)}


def wants_chat_template(mode: str, tokenizer) -> bool:
    """`auto`: the model's tokenizer has a chat template (an SFT export keeps the one it trained with)."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ConfigError(f"chat template mode must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and bool(getattr(tokenizer, "chat_template", None)))


def run(
    model,
    selection: TaskSelection,
    *,
    model_args: Optional[dict] = None,
    limit: Optional[float] = None,
    batch_size="1",
    chat_template: bool = False,
    log_samples: bool = False,
    gen_kwargs: Optional[dict] = None,
) -> dict:
    """`lm_eval.simple_evaluate` with the CLI's defaults. `model`: "hf" with `model_args`, or an lm-eval `LM`
    (the live model in training: in_training.LiveEval). `gen_kwargs` join every generation task's settings.
    Returns lm-eval's results dict (None on a process whose LOCAL_RANK is not 0)."""
    quiet()
    import torch
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=model,
        model_args=model_args,
        # what the CLI's default (cuda:0) comes to: the first GPU, else the CPU
        device="cuda:0" if torch.cuda.is_available() else "cpu",
        tasks=selection.names,
        batch_size=batch_size,
        limit=limit,
        log_samples=log_samples,
        apply_chat_template=chat_template,
        gen_kwargs=gen_kwargs,
        task_manager=task_manager(tuple(selection.include), selection.defaults),
        verbosity="WARNING",
    )


def limit_of(value: Optional[float]):
    """lm-eval's --limit: a count when >= 1 (40.0 -> 40, as its CLI parses it), else a fraction; None: all."""
    return int(value) if value is not None and value >= 1 else value


def cli_command(model_dir: Path, selection: TaskSelection, limit, batch_size, chat_template: bool) -> str:
    """The `lm_eval` command that gives the same numbers."""
    args = ",".join(f"{k}={v}" for k, v in model_args(model_dir).items())
    parts = ["lm_eval", "--model", "hf", "--model_args", args, "--tasks", ",".join(selection.names)]
    extra = [p for p in selection.include if p != str(TASKS_DIR)]
    parts += ["--include_path", str(TASKS_DIR)] + (["--include_path", *extra] if extra else [])
    parts += ["--batch_size", str(batch_size)] + (["--limit", str(limit)] if limit is not None else [])
    return " ".join(parts + (["--apply_chat_template"] if chat_template else []))


@dataclass
class Score:
    task: str
    metric: str
    value: float
    stderr: Optional[float]


def scores(results: dict) -> list[Score]:
    """Every task's metrics from lm-eval's results (`acc,none` -> metric `acc`, filter `none` dropped)."""
    out = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or key.split(",")[0].endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            err = metrics.get(f"{metric}_stderr,{filt}")
            name = metric if filt == "none" else f"{metric} ({filt})"
            out.append(Score(task, name, float(value), float(err) if isinstance(err, (int, float)) else None))
    return out


def table(rows: list[Score]) -> str:
    lines = [("task", "metric", "value", "stderr")]
    lines += [(s.task, s.metric, f"{s.value:.4f}", "" if s.stderr is None else f"± {s.stderr:.4f}") for s in rows]
    widths = [max(len(r[i]) for r in lines) for i in range(4)]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(lines[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in lines[1:]])


def flat_metrics(rows: list[Score]) -> dict[str, float]:
    """For metrics.jsonl, TensorBoard and plot_metrics.py: `eval_<task>_<metric>`."""
    return {f"eval_{s.task}_{s.metric}".replace(" ", "_").replace("(", "").replace(")", ""): s.value for s in rows}
