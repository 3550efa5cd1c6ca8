"""`tools/clean_data.py --executor local|ray|slurm`: the cleaning steps as datatrove pipelines, one per stage,
run by datatrove's executors, for corpora larger than one machine's memory.

Stages (`stages`): 0. lines (each task counts the newlines of its byte range); 1. clean (`--tasks` shares of the input: edits, judges, signatures); then, with `--dedupe`,
2. verified pairs (the bands shared among up to `--tasks` tasks), 3. clusters (one task), 4. filter (`--tasks`); last, the report (one
task). Memory per task is a batch of documents and one record per open signature file; the cluster task holds
the duplicates only.

Files, beside `--output DIR` (which holds only the kept rows, `00000.jsonl`..., for train.py's --dataset_name):
`DIR.report.json`, `DIR.removed/` (the removed rows with why), and `DIR.work/` (signatures, the documents between
stages, datatrove's logs and completions unless `--logging_dir`). A rerun of the same command skips the tasks
datatrove marked complete, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor, RayPipelineExecutor, SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep

from ..checkpointing import atomic
from ..errors import ConfigError
from . import dedupe, formats
from .clean_dedupe_steps import ClusterDuplicates, DropDuplicates, FindDuplicatePairs
from .clean_file import EXAMPLES_PER_REASON, check_paths, report_path, summary_lines
from .clean_steps import CleanRows, CountLines, ReadRows, WriteRows, WriteSignatures, published, row_text
from .cleaning import Cleaner, check_format
from .options import DataOptions

ENGINES = ("local", "ray", "slurm")


def removed_dir(output: Path) -> Path:
    return output.with_name(output.name + ".removed")


def work_dir(output: Path) -> Path:
    return output.with_name(output.name + ".work")


class StageFailed(RuntimeError):
    """A task of a stage did not complete (its exception is in datatrove's log for it)."""


class Plan:
    """Where every stage reads and writes, from the output directory and the options."""

    def __init__(self, cfg, output: Path, tasks: int, logging_dir: Path | None):
        self.input, self.output, self.tasks = Path(cfg.dataset_name).resolve(), output.resolve(), tasks
        self.work = work_dir(self.output)
        self.logs = (logging_dir or self.work / "logs").resolve()
        self.data_opts, self.fmt = read_options(cfg, self.input)
        self.opts = self.data_opts.tokenize
        self.threshold = cfg.dedupe_threshold
        mode = self.opts.dedupe
        self.bands, self.rows = dedupe.band_shape(self.threshold) if mode == "near" else (1, 2)
        self.width = dedupe.NUM_HASHES if mode == "near" else 2
        self.threshold_used = self.threshold if mode == "near" else 1.0
        self.reason = {"near": f"near duplicates (similarity >= {self.threshold})", "exact": "exact duplicates"}.get(
            mode
        )

    def path(self, name: str) -> str:
        return str(self.work / name)

    def manifest(self) -> dict:
        stat = self.input.stat()
        options = asdict(self.opts) | {"dedupe_threshold": self.threshold}
        return {
            "input": str(self.input),
            "size": stat.st_size,
            "mtime": stat.st_mtime,
            "options": options,
            "tasks": self.tasks,
        }


def read_options(cfg, path: Path):
    """The data options and the format train.py would detect, from the file's first row."""
    with open(path, "rb") as f:
        first = next((line for line in f if line.strip()), b"")
    try:
        columns = list(json.loads(first))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
        raise ConfigError(f"the first line of {path} is not a JSON object; --executor reads JSON lines") from None
    opts = DataOptions.from_config(cfg)
    fmt, _ = formats.detect_format(opts.tokenize.format, columns, opts.tokenize.text_column, str(path))
    opts = opts.resolved(fmt)
    check_format(opts.tokenize, str(path))
    return opts, fmt


def stages(plan: Plan) -> list[tuple[str, list, int]]:
    """(name, pipeline, tasks) per stage, in order."""
    p, deduping = plan, plan.opts.dedupe != "none"
    first = [
        ReadRows(str(p.input), p.path("lines")),
        CleanRows(p.data_opts, p.fmt, str(removed_dir(p.output)), p.path("parts"), p.path("staging")),
    ]
    if deduping:
        first.append(WriteSignatures(p.path("sigs"), p.bands, p.rows, p.width))
    first.append(WriteRows(p.path("kept") if deduping else str(p.output), p.path("staging"), with_index=deduping))
    out = [("0-lines", [CountLines(str(p.input), p.path("lines"))], p.tasks), ("1-clean", first, p.tasks)]
    if deduping:
        out += [
            ("2-pairs", [FindDuplicatePairs(p.path("sigs"), p.path("pairs"), p.bands, p.rows, p.width, p.threshold_used)], min(p.bands, p.tasks)),
            ("3-clusters", [ClusterDuplicates(p.path("sigs"), p.path("pairs"), p.path("remove"), p.width)], 1),
            ("4-filter", [DropDuplicates(p.path("kept"), p.path("remove"), str(p.output), str(removed_dir(p.output)),
                                         p.path("parts"), p.path("staging"), p.reason, p.fmt, p.opts)], p.tasks),
        ]  # fmt: skip
    out.append(("5-report", [WriteReport(plan)], 1))
    return out


class WriteReport(PipelineStep):
    """The last stage: the tasks' parts merged into the in-memory path's report, written beside the output."""

    name = "report"
    type = "WRITER"

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        report = merged_report(self.plan)
        with published(report_path(self.plan.output), Path(self.plan.path("staging"))) as f:
            f.write(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        return iter(())


def merged_report(plan: Plan) -> dict:
    parts = Path(plan.path("parts"))
    cleaned = [json.loads(p.read_text()) for p in sorted(parts.glob("clean-*.json"))]
    report = {
        "format": plan.fmt,
        "options": {k: v for k, v in asdict(plan.opts).items() if k not in ("format", "train_on_prompt")},
        "documents": sum(p["documents"] for p in cleaned),
        "edited": {s: sum(p["edited"].get(s, 0) for p in cleaned) for s, _ in Cleaner(plan.opts).edits},
        "removed": {},
    }
    report["options"]["dedupe_threshold"] = plan.threshold
    for why in sorted({w for p in cleaned for w in p["removed"]}):
        seen = [p["removed"][why] for p in cleaned if why in p["removed"]]
        examples = [e for s in seen for e in s["examples"]][:EXAMPLES_PER_REASON]
        report["removed"][why] = {"documents": sum(s["documents"] for s in seen), "examples": examples}
    if plan.reason:
        seen = [json.loads(p.read_text())["removed"][plan.reason] for p in sorted(parts.glob("dedupe-*.json"))]
        examples = [duplicate_example(plan, e) for s in seen for e in s["examples"]][:EXAMPLES_PER_REASON]
        report["removed"][plan.reason] = {"documents": sum(s["documents"] for s in seen), "examples": examples}
    report["kept"] = report["documents"] - sum(r["documents"] for r in report["removed"].values())
    started = json.loads((plan.work / "run.json").read_text())["started"]
    seconds = time.time() - started
    report.update(input=str(plan.input), output=str(plan.output), removed_rows=str(removed_dir(plan.output)))
    report.update(seconds=round(seconds, 2), documents_per_second=round(report["documents"] / max(seconds, 1e-9), 1))
    report["tasks"] = plan.tasks
    return report


def duplicate_example(plan: Plan, e: dict) -> dict:
    """A removed duplicate as the in-memory report shows it: with the kept document it repeats."""
    file, doc, index = e["of"]
    with open(Path(plan.path("kept")) / f"{file:05d}.jsonl", encoding="utf-8") as f:
        for _ in range(doc):
            f.readline()
        row = json.loads(f.readline())["row"]
    out = {
        "index": e["index"],
        "text": e["text"],
        "duplicate_of": {"index": index, "text": row_text(row, plan.fmt, plan.opts)},
    }
    if plan.opts.dedupe == "near":
        out["similarity"] = round(e["similarity"], 3)
    return out


# ---- checks, then the engines ---------------------------------------------------------------------------


def check(cfg, output: Path, engine: str, tasks: int, workers: int, partition: str | None) -> str | None:
    """Everything refused before a file is written, one line each; returns the Slurm partition to use."""
    if tasks < 1:
        raise ConfigError(f"--tasks must be at least 1, got {tasks}")
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    src = Path(os.path.expanduser(cfg.dataset_name))
    if src.exists() and (src.is_dir() or src.suffix != ".jsonl"):
        raise ConfigError(
            f"--executor reads one JSON-lines file (.jsonl), and {cfg.dataset_name} is not one; convert it "
            "(datasets' to_json(..., lines=True)) or clean it without --executor"
        )
    check_paths(cfg, output)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file; --executor writes a directory of shards, name a new one")
    if engine == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("--executor ray needs Ray: pip install ray (or use --executor local)") from None
    if engine != "slurm":
        return None
    if shutil.which("sbatch") is None:
        raise ConfigError("--executor slurm needs Slurm's sbatch on PATH; run it on a cluster's login node")
    partition = partition or default_partition()
    # Slurm's own verdict on the partition (and account, limits), without submitting anything
    done = subprocess.run(
        ["sbatch", "--test-only", "--partition", partition, "--wrap", "true"], capture_output=True, text=True
    )
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        raise ConfigError(f"Slurm refused a job on partition {partition}: {said[-1] if said else done.returncode}")
    return partition


def default_partition() -> str:
    """The cluster's default partition (sinfo marks it with *): datatrove's executor must name one."""
    listed = subprocess.run(["sinfo", "--noheader", "--format", "%P"], capture_output=True, text=True).stdout.split()
    default = [p.rstrip("*") for p in listed if p.endswith("*")]
    if not default:
        raise ConfigError("this Slurm cluster has no default partition; pass --partition NAME (sinfo lists them)")
    return default[0]


def check_resumable(plan: Plan) -> None:
    """An output directory (and its work directory) is this run's to resume, or it is refused."""
    held = [p for p in (plan.output, plan.work) if p.exists() and any(p.iterdir())]
    if not held:
        return
    saved = plan.work / "run.json"
    if not saved.exists():
        raise ConfigError(f"--output {plan.output} already holds files of something else; name a new directory")
    was = json.loads(saved.read_text())
    now = plan.manifest()
    differ = [k for k in now if was.get(k) != now[k]]
    if differ:
        raise ConfigError(
            f"--output {plan.output} holds another run's shards (its {', '.join(differ)} differ); "
            f"name a new directory, or delete it and {plan.work.name} to start over"
        )


def begin(plan: Plan) -> None:
    """Create the directories and record what this run is (a rerun keeps the first start time)."""
    saved = plan.work / "run.json"
    started = json.loads(saved.read_text())["started"] if saved.exists() else time.time()
    plan.output.mkdir(parents=True, exist_ok=True)
    plan.work.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(plan.manifest() | {"started": started}, indent=1) + "\n")


def executors(plan: Plan, engine: str, workers: int, partition: str | None, time_limit: str) -> list:
    """(stage name, its datatrove executor), each with its own logging directory (its completions)."""
    made = []
    for name, pipeline, tasks in stages(plan):
        common = dict(pipeline=pipeline, tasks=tasks, workers=min(workers, tasks), logging_dir=str(plan.logs / name))
        if engine == "local":
            made.append((name, LocalPipelineExecutor(**common)))
        elif engine == "ray":
            made.append((name, RayPipelineExecutor(**common, mem_per_cpu_gb=1)))
        else:
            made.append((name,
                SlurmPipelineExecutor(
                    **common, depends=made[-1][1] if made else None, partition=partition, time=time_limit,
                    job_name=f"clean-{name}", cpus_per_task=1, mem_per_cpu_gb=1,
                    slurm_logs_folder=str(plan.logs / name / "slurm"),
                ),
            ))  # fmt: skip
    return made


def run(plan: Plan, engine: str, workers: int, partition: str | None, time_limit: str, log=print) -> dict | None:
    """Run every stage (local, Ray: here, in order, then return the report) or submit them (Slurm: chained by
    dependencies; returns None, and the report appears beside the output when the last job ends)."""
    check_resumable(plan)
    begin(plan)
    chain = executors(plan, engine, workers, partition, time_limit)
    if engine == "slurm":
        chain[-1][1].run()  # submits its dependencies first
        ids = ", ".join(str(e.job_id) for _, e in chain)
        log(f"clean: submitted Slurm jobs {ids}; the report will be {report_path(plan.output)} (squeue to watch)")
        return None
    if engine == "ray":
        import ray

        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    seconds = {}
    for name, stage in chain:
        start = time.perf_counter()
        try:
            stage.run()
        except Exception as e:  # a task's own error, already in its log: said in one line, and resumable
            raise StageFailed(f"stage {name} failed: {type(e).__name__}: {e}; {resume_hint(plan, name)}") from None
        if failed := stage.get_incomplete_ranks(skip_completed=True):
            raise StageFailed(
                f"stage {name}: task(s) {', '.join(map(str, failed[:5]))} did not finish; {resume_hint(plan, name)}"
            )
        seconds[name] = round(time.perf_counter() - start, 1)  # where the time goes: what more machines would cut
    report = json.loads(report_path(plan.output).read_text()) | {"stage_seconds": seconds}
    atomic.write_text(report_path(plan.output), json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    for line in summary_lines(report):
        log(line)
    log("  stages: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()))
    return report


def resume_hint(plan: Plan, stage: str) -> str:
    return f"logs in {plan.logs / stage / 'logs'}; the same command resumes from the tasks that finished"
