"""The training room's unit tests run their collectives (the log window's record, the guard's all-reduce) in a
one-rank gloo group, started once per file that asks for it."""

import pytest
import torch.distributed as dist

from helpers import free_port


@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
