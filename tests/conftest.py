"""Session fixtures: one data cache, and each (config, precision) trained once for the tests that share it.
The helpers they use are in helpers.py (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os

import pytest

from helpers import CONFIGS, FAST, INJECT, PRECISIONS, aio_available, launch


def pytest_configure(config):
    """Every process a test launches loads tests/inject/sitecustomize.py (faults on request, port ranges).
    Under pytest-xdist (pytest.ini runs 2 workers) each worker picks ports from its own range below the
    kernel's ephemeral ports (32768+), so parallel launches never collide (distributed.free_port)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(INJECT), os.environ.get("PYTHONPATH")]))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        lo = 12000 + 2000 * int(worker[2:])
        os.environ["ZERO_RECIPES_TEST_PORTS"] = f"{lo}:{lo + 2000}"


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """One embedded corpus/tokenizer/blocks cache for the session (train.py builds it on first use)."""
    cache = tmp_path_factory.mktemp("zero-recipes-cache")
    os.environ["ZERO_RECIPES_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Run each (config, precision) once per session; the parity tests reuse the runs."""
    runs = {}

    def get(name: str, precision: str):
        if (name, precision) not in runs:
            if name == "zero3+nvme" and not aio_available():
                pytest.skip("NVMe offload needs libaio: apt-get install libaio-dev (not a pass: not run here)")
            out = tmp_path_factory.mktemp(f"{name}-{precision}")
            extra = []
            if "nvme" in name:  # an NVMe directory must exist, as on a real machine (train.py does not create it)
                (out / "nvme").mkdir()
                extra = ["--nvme_path", str(out / "nvme")]
            # a checkpoint at step 4 too, so resume tests can start from these runs' middle
            runs[name, precision] = launch(
                FAST
                + [
                    "--deepspeed",
                    *CONFIGS[name],
                    *PRECISIONS[precision],
                    "--verify_export",
                    "--save_steps",
                    "4",
                    *extra,
                ],
                out / "run",
            )
        return runs[name, precision]

    return get
