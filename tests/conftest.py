"""Session fixtures: one data cache, and each (config, precision) trained once for the tests that share it
(once per pytest invocation, across xdist workers: shared_runs.py).
The helpers they use are in helpers.py (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os

import pytest

import contract
import file_seconds
from helpers import CONFIGS, FAST, INJECT, PRECISIONS, SFT, SFT_ZERO0_BATCH, aio_available
from shared_runs import SharedRuns

# Launch sizes: most launches run 2 ranks (some 4), so a worker needs about 2 cores for its launch to run at
# the speed the tests were sized on. On 2 cores, 2 workers still win: one worker's launch spends seconds in
# imports and start-up while the other's trains (measured: docs/dev/test-suite.md).
CORES_PER_WORKER = 2
# Below the kernel's ephemeral ports (32768+), split between the workers. ZERO_RECIPES_TEST_PORT_RANGE="LO:HI"
# gives a pytest invocation its own range, for two invocations at once on one machine.
PORTS = tuple(int(x) for x in os.environ.get("ZERO_RECIPES_TEST_PORT_RANGE", "12000:32000").split(":"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one worker per 2 cores, and never fewer than 2."""
    return max(2, len(os.sched_getaffinity(0)) // CORES_PER_WORKER)


def pytest_collection_modifyitems(config, items):
    """Longest files first (file_seconds.py), each file's tests in their own order; pytest.ini's
    --no-loadscope-reorder makes pytest-xdist hand files out in this order."""
    table = file_seconds.measured()
    items.sort(key=lambda item: -file_seconds.seconds(item.nodeid.split("::")[0], table))


def pytest_configure(config):
    """Every process a test launches loads tests/inject/sitecustomize.py (faults on request, port ranges).
    Under pytest-xdist each worker picks ports from its own slice of PORTS, so parallel launches never collide
    (distributed/ports.py). With more cores than 2 per worker, each worker is pinned to its own cores (what it
    launches inherits them), so train.py gives each rank the same thread count as on a 2-core host and the
    workers' ranks do not compete."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT), os.environ.get("PYTHONPATH")]))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    index, count = int(worker[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 2))
    span = (PORTS[1] - PORTS[0]) // count
    lo = PORTS[0] + span * index
    os.environ["ZERO_RECIPES_TEST_PORTS"] = f"{lo}:{lo + span}"
    cores = sorted(os.sched_getaffinity(0))
    per_worker = len(cores) // count
    if per_worker >= CORES_PER_WORKER:
        os.sched_setaffinity(0, cores[index * per_worker : (index + 1) * per_worker])


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """One embedded corpus/tokenizer/blocks cache for the session (train.py builds it on first use)."""
    cache = tmp_path_factory.mktemp("zero-recipes-cache")
    os.environ["ZERO_RECIPES_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, worker_id):
    """Runs trained once per pytest invocation, whichever xdist worker asks first (shared_runs.py)."""
    root = tmp_path_factory.getbasetemp()
    return SharedRuns((root.parent if worker_id != "master" else root) / "shared-runs")


def baseline_launcher(name: str, precision: str) -> str:
    """The quick start's run (ZeRO-3, fp32) under the `deepspeed` launcher, as the README gives it; the other
    baselines' subject is their config: torchrun's agent starts them as ranks forked from a preloaded
    forkserver, with the same bits and without each rank importing torch, transformers and DeepSpeed again
    (docs/dev/test-suite.md#launchers). Resume tests compare one launcher's runs with the other's, exactly."""
    return "deepspeed" if (name, precision) == ("zero3", "fp32") else "forked"


@pytest.fixture(scope="session")
def trained(shared_runs):
    """Each (config, precision) trained once per pytest invocation; the parity tests reuse the runs."""

    def get(name: str, precision: str):
        if name == "zero3+nvme" and not aio_available():
            pytest.skip("NVMe offload needs libaio: apt-get install libaio-dev (not a pass: not run here)")

        def nvme_dir(where):  # an NVMe directory must exist, as on a real machine (train.py does not create it)
            (where / "nvme").mkdir(exist_ok=True)
            return ["--nvme_path", str(where / "nvme")]

        # a checkpoint at step 4 too, so resume tests can start from these runs' middle
        args = FAST + ["--deepspeed", *CONFIGS[name], *PRECISIONS[precision], "--verify_export", "--save_steps", "4"]
        prepare = nvme_dir if "nvme" in name else None
        return shared_runs.get(
            f"{name}-{precision}", args, launcher=baseline_launcher(name, precision), prepare=prepare
        )

    return get


@pytest.fixture(scope="session")
def sft_zero0(shared_runs):
    """The ZeRO-0 SFT baseline, packed or not, that the tensor- and sequence-parallel SFT parity tests read
    (helpers.SFT): one run per packing for the whole invocation, as `trained` is for text."""

    def get(packing: str):
        args = FAST + ["--deepspeed", *CONFIGS["zero0"], *SFT, "--packing", packing, *SFT_ZERO0_BATCH]
        return shared_runs.get(f"sft-zero0-packing-{packing}", args, launcher="forked")

    return get


@pytest.fixture(scope="session")
def bases(trained, shared_runs):
    """What an argument list's base-model placeholders name (contract.LORA_BASE, QLORA_BASE), made on first use."""

    def get(args) -> dict[str, str]:
        named = {}
        if contract.LORA_BASE in args:  # a quick-start-like model directory: the session's ZeRO-3 fp32 run
            named[contract.LORA_BASE] = str(trained("zero3", "fp32").check().output_dir)
        if contract.QLORA_BASE in args:
            named[contract.QLORA_BASE] = str(shared_runs.made("qlora-base", make_qlora_base))
        if contract.DPO_PAIRS in args:
            named[contract.DPO_PAIRS] = str(shared_runs.made("dpo-pairs", make_dpo_pairs) / "pairs.jsonl")
        for a in args:
            if a.startswith(contract.dpo_reference("")[:-1]):  # a row's own reference file (contract.dpo)
                named[a] = str(
                    shared_runs.root / "dpo-references" / f"{a[len(contract.dpo_reference('')) - 1 : -1]}.npz"
                )
        return named

    return get


def make_dpo_pairs(out) -> None:
    """80 preference pairs of the embedded set (TRL's conversational format): a step of 8 pairs, each epoch 9 of
    them held out; the reference pass over all of them is a second per row."""
    import json

    from zero_recipes.data.builtin import preference_examples

    out.mkdir(parents=True, exist_ok=True)
    (out / "pairs.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in preference_examples(80)))


def make_qlora_base(out) -> None:
    """A pretrained-style base whose layers are multiples of 64 wide: bitsandbytes' CPU 4-bit kernel needs that
    (the LoRA base has a 352-wide MLP, which QLoRA refuses on a CPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from zero_recipes.config.train_config import TrainConfig
    from zero_recipes.data import builtin_tokenizer_dir
    from zero_recipes.modeling.model import TINY_LLAMA

    tokenizer = AutoTokenizer.from_pretrained(builtin_tokenizer_dir(TrainConfig()))
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    fields.update(intermediate_size=384, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields)).save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="session")
def mode_run(trained, shared_runs, bases):
    """A contract row's run (tests/contract.py): 8 steps, a checkpoint at step 4, the export verified; trained
    once per pytest invocation. The ZeRO rows are `trained`'s fp32 runs."""

    def get(mode: contract.Mode):
        if mode.family == "zero":
            return trained(mode.name, "fp32")
        args = contract.mode_args(mode.args, bases) + ["--save_steps", "4", "--verify_export"]
        launcher = f"forked+{mode.watch}" if mode.watch else "forked"
        return shared_runs.get(f"mode-{mode.name}", args, nproc=mode.nproc, launcher=launcher)

    return get


@pytest.fixture(scope="session")
def baseline_run(trained, shared_runs, bases):
    """The ZeRO-0 run a contract row is compared with, on the same global batch (contract.BASELINES)."""

    def get(mode: contract.Mode):
        if mode.baseline == "zero0":
            return trained("zero0", "fp32")
        args, key = contract.BASELINES[mode.baseline]
        return shared_runs.get(key, contract.mode_args(args, bases) + ["--save_steps", "4"], launcher="forked")

    return get
