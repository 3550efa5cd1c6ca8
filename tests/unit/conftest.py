"""The unit tier launches nothing: no launcher, no DeepSpeed child process, no JIT build of an op (each of those
starts a process). Enforced here rather than promised: a unit test that starts a process fails and says where
it belongs."""

import subprocess

import pytest


@pytest.fixture(autouse=True)
def no_processes(monkeypatch, request):
    def refuse(self, args, *a, **k):
        raise AssertionError(
            f"{request.node.nodeid} starts a process ({args!r}); the unit tier launches nothing: "
            "move the test to tests/integration"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
