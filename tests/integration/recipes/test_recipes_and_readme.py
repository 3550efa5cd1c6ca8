"""What the docs promise a user, checked where it is written: every shipped recipe resolves under --dry_run, offline;
every JSON in ds_configs/ is in ds_configs/README.md's table and each combination a row names resolves; the
README's test command is what .ci/run runs; the README's recipe memory column matches the recipe headers;
the docs' relative links point at files that exist. No test depends on a document's headings."""

import re
import shlex
import socket
import threading
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO, dry_run_in_process, free_port, refusal, tool_in_process
from zero_recipes.config.shipped import ARCHITECTURES

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
README = (REPO / "README.md").read_text()
DS_README = (REPO / "ds_configs" / "README.md").read_text()
GPU_ONLY = {"zenflow.json", "superoffload.json", "deepcompile.json", "offload_activations.json"}


def ds_config_rows() -> list[list[str]]:
    """The `--deepspeed ...` combinations in ds_configs/README.md's table (rows that start with one)."""
    rows = re.findall(r"^\|\s*`(--deepspeed [^`]+)`", DS_README, flags=re.M)
    return [shlex.split(r) for r in rows]


@pytest.fixture(scope="module")
def quick_start_model(tmp_path_factory):
    """Stands in for outputs/tiny-llama, which recipes that fine-tune the quick start's model need: the
    embedded architecture, saved untrained (a dry run reads only its config)."""
    from transformers import AutoConfig

    from zero_recipes.modeling.model import TINY_LLAMA

    out = tmp_path_factory.mktemp("quick-start-model")
    fields = dict(TINY_LLAMA)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(out)
    return out


class Hub:
    """A hub endpoint on this worker's ports that drops every connection it accepts, and counts them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", free_port()))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.connections += 1
            conn.close()


@pytest.fixture(scope="module", autouse=True)
def stages_traced_once():
    """The pipeline recipes' stages are traced once per distinct input in this module. Each recipe's dry run
    (hub offline both ways) and its header's estimate ask for the same stages' activations, and the trace
    (FakeTensorMode over DeepSpeed's 1F1B schedule: 18-21 s for the 70B pp8 recipe on 2 cores) is a pure
    function of its inputs. The estimates themselves run as a user's do."""
    import copy

    from zero_recipes.memory import pipeline_trace

    real, traced = pipeline_trace.all_stages, {}

    def once(model_config, stages, micro_batches, launch, bytes_per_param):
        key = (model_config.to_json_string(), repr(stages), micro_batches, repr(launch), bytes_per_param)
        if key not in traced:
            traced[key] = real(model_config, stages, micro_batches, launch, bytes_per_param)
        return copy.deepcopy(traced[key])

    pipeline_trace.all_stages = once
    yield
    pipeline_trace.all_stages = real


@pytest.fixture(params=["HF_HUB_OFFLINE", "hub unreachable"])
def hub_offline(request, monkeypatch):
    """The hub offline, both ways a user meets it; yields (the reason train.py must give, the endpoint that
    counts what was asked of it). HF_HUB_OFFLINE=1 is set where huggingface_hub reads it
    (constants.HF_HUB_OFFLINE, at import); "unreachable" is its endpoint (HF_ENDPOINT, constants.ENDPOINT)."""
    from huggingface_hub import constants

    hub = Hub()
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", request.param == "HF_HUB_OFFLINE")
    yield ("HF_HUB_OFFLINE is set" if request.param == "HF_HUB_OFFLINE" else f"no answer from {hub.endpoint}"), hub
    hub.sock.close()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_dry_runs_offline_as_shipped_and_header_carries_its_command(recipe, hub_offline, tmp_path):
    """Every recipe as shipped, the hub offline: its architecture from recipes/configs/ (the same file its
    '# Memory:' command names), the quick start's model before the quick start ran, and saying so. The hub is
    asked once at most (one probe), not through huggingface_hub's retries (26 s of them, measured)."""
    hub_offline, hub = hub_offline
    text = recipe.read_text()
    for label in ("# Trains:", "# Hardware:", "# Launch:", "# Memory:"):
        assert label in text, f"{recipe.name} header lacks {label}"
    launch_line = next(line for line in text.splitlines() if line.startswith("# Launch:"))
    assert f"recipes/{recipe.name}" in launch_line and "train.py" in launch_line
    out = dry_run_in_process("--recipe", recipe, "--output_dir", tmp_path / "run")
    assert "plan: model" in out and '"auto"' not in out
    assert "memory: estimated peak" in out  # the dry run shows tools/estimate_memory.py's estimate
    fields = yaml.safe_load(text)
    model = fields.get("model_name_or_path")
    if model == "outputs/tiny-llama":
        assert "# Needs:" in text and "quick start" in text  # the header says to run the quick start first
        assert "note: outputs/tiny-llama does not exist yet (the quick start writes it)" in out
    elif model == "outputs/tiny-sft":
        assert "# Needs:" in text and "recipes/tiny-sft.yaml" in text
        assert "note: outputs/tiny-sft does not exist yet (recipes/tiny-sft.yaml writes it)" in out
    elif model:
        assert model in ARCHITECTURES, f"{recipe.name}: add {model}'s published config to shipped.ARCHITECTURES"
        named = re.search(r"--model (recipes/configs/\S+\.json)", text)
        assert named and named.group(1) == ARCHITECTURES[model], f"{recipe.name}: '# Memory:' names another config"
        assert f"note: hub offline ({hub_offline}" in out and f"{model}, {ARCHITECTURES[model]}" in out
    if not fields["dataset_name"].startswith("builtin:"):
        assert f"data: {fields['dataset_name']}: a hub dataset, not read (hub offline: {hub_offline}" in out
    assert hub.connections <= (0 if hub_offline.startswith("HF_HUB_OFFLINE") else 1), hub.connections


def test_every_shipped_architecture_is_a_hub_models_config():
    shipped = {f"recipes/configs/{p.name}" for p in (REPO / "recipes" / "configs").glob("*.json")}
    assert sorted(ARCHITECTURES.values()) == sorted(shipped), "shipped.ARCHITECTURES names each file once"


def test_a_lora_recipe_takes_a_model_config_for_its_dry_run_and_says_so(tmp_path):
    recipe = ["--recipe", "recipes/llama-3.1-8b-lora-24gb.yaml", "--model_config", "recipes/configs/llama-3.1-8b.json"]
    out = dry_run_in_process(*recipe, "--output_dir", tmp_path)
    assert "note: --model_config stands in for the architecture of meta-llama/Llama-3.1-8B in this dry run" in out
    assert "plan: model llama 8030.26M parameters" in out
    # training would build the base from the config instead of loading its weights: refused, with the reason
    line = refusal(*recipe, "--output_dir", tmp_path, "--deepspeed", "ds_configs/zero2.json")
    assert "LoRA adapts pretrained weights" in line and "without --model_config" in line


def test_ds_configs_readme_lists_every_config():
    rows = ds_config_rows()
    assert len(rows) >= 8
    shipped = {p.name for p in (REPO / "ds_configs").glob("*.json")}
    named = {Path(a).name for row in rows for a in row[1:]}
    assert named == shipped, f"ds_configs/README.md's combinations name {sorted(named)}; shipped: {sorted(shipped)}"
    # and each file has its own row (and its own reasons) in the table of files
    described = set(re.findall(r"^\|\s*`(\w+\.json)`", DS_README, flags=re.M))
    assert described == shipped, f"ds_configs/README.md describes {sorted(described)}; shipped: {sorted(shipped)}"


@pytest.mark.parametrize("row", ds_config_rows(), ids=lambda r: "+".join(Path(a).stem for a in r[1:]))
def test_ds_configs_readme_row_resolves(row, tmp_path):
    extra = ["--nvme_path", str(tmp_path)] if any("nvme" in a for a in row) else []
    # the embedded Llama: 4 heads, 2 KV heads, 4 layers
    if any(a.endswith(("tp4.json", "tp8.json", "sp8.json", "pp8.json")) for a in row):
        extra += ["--model_config", "recipes/configs/llama-3.1-8b.json"]
    if any("/ep" in a for a in row):  # expert parallelism needs experts: Mixtral-8x7B's 8 per layer
        extra += ["--model_config", "recipes/configs/mixtral-8x7b-v0.1.json"]
    gpu_only = [Path(a).name for a in row if Path(a).name in GPU_ONLY]
    if gpu_only and not torch.cuda.is_available():  # refused here in one line that names the alternative
        line = refusal(*row, *extra, "--dry_run")
        assert "needs" in line and "CUDA" in line and f"ds_configs/{gpu_only[0]}" in line, line
        return
    out = dry_run_in_process(*row, *extra)
    assert "resolved DeepSpeed config" in out and '"auto"' not in out


def test_readme_test_command_is_what_ci_runs():
    """The README's quick start line for the tests is exactly .ci/run's commands, in its order."""
    line = "pip install -r requirements.txt && python tools/build_ops.py && python -m pytest"
    assert line in README
    assert "python -m pytest tests/unit" in README  # the unit tier on its own
    ci = [s.strip() for s in (REPO / ".ci" / "run").read_text().splitlines()]
    at = [ci.index(cmd) for cmd in line.split(" && ")]  # each a line of its own, ValueError if missing
    assert at == sorted(at), f".ci/run runs {line.split(' && ')} in another order"


def test_readme_stays_a_front_page():
    # issue 49: the README is a front page (quick start, configs, recipes, links); the rest lives in docs/
    assert len(README.encode()) <= 9 * 1024, f"README.md is {len(README.encode())} bytes; move detail into docs/"


def test_readme_recipe_memory_column_matches_headers():
    """The README's est. peak / GPU column is the figure each recipe's '# Memory:' header states (which
    test_recipe_header_memory_estimate_is_current keeps equal to tools/estimate_memory.py)."""
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\|\s*`recipes/([\w.-]+\.yaml)`.*$", README, flags=re.M)}
    assert set(rows) == {p.name for p in RECIPES}, "the README's recipe tables must list every recipe"
    for recipe in RECIPES:
        stated = re.search(r"estimated peak ([0-9.]+) GiB per GPU", recipe.read_text()).group(1)
        shown = re.findall(r"\|\s*([0-9.]+) GiB\s*\|", rows[recipe.name])
        assert shown in ([], [stated]), f"README says {shown} GiB for {recipe.name}; its header says {stated}"


DOCS = [REPO / "README.md", REPO / "ds_configs" / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_doc_links_resolve(doc):
    """Relative links (README into docs/, docs into benchmarks/ and tools/) point at files that exist."""
    missing = []
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        path = link.split("#", 1)[0]
        if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
            missing.append(link)
    assert not missing, f"{doc.relative_to(REPO)} links to missing files: {missing}"


def test_fp16_config_resolves_to_fp16_only():
    # This CPU has no fp16 kernels (DeepSpeed refuses); the fp16 fragment is checked by resolution here and
    # trains in the GPU suite.
    out = dry_run_in_process("--deepspeed", "ds_configs/zero2.json", "ds_configs/fp16.json")
    assert '"fp16": {\n    "enabled": true' in out and '"bf16": {\n    "enabled": false' in out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_header_memory_estimate_is_current(recipe, quick_start_model):
    """The '# Memory:' header names tools/estimate_memory.py's command and the peak it prints today (run in this
    process: test_estimate_memory.py runs the tool as a process)."""
    header = recipe.read_text().split("# Memory:", 1)[1].split("\n# Result", 1)[0]
    stated = re.search(r"estimated peak ([0-9.]+) GiB per GPU", header)
    command = re.search(r"(python tools/estimate_memory\.py [^\n]+)", header)
    assert stated and command, f"{recipe.name}: '# Memory:' must give the estimate and the command that made it"
    args = shlex.split(command.group(1))[2:]
    if re.search(r"model_name_or_path: outputs/tiny-(llama|sft)\n", recipe.read_text()):
        args += ["--model", str(quick_start_model)]  # the quick start's output, stood in for
    proc = tool_in_process("estimate_memory", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = re.search(r"peak per GPU: ([0-9.]+) GiB", proc.stdout).group(1)
    assert printed == stated.group(1), f"{recipe.name} says {stated.group(1)} GiB; the tool now says {printed}"


def test_the_gpu_kits_command_is_the_one_docs_speed_gives():
    # the lent GPU's 15 minutes are spent on the line docs/speed.md shows: it must be the script's
    import subprocess

    command = subprocess.run(
        ["bash", "tools/gpu_kit.sh", "--command"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert "tools/benchmark.py gpu --out-dir $OUT" in command
    assert f"\n{command}\n" in (REPO / "docs" / "speed.md").read_text()
