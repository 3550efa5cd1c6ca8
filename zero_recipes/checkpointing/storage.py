"""When storage says no: a full disk, a quota, a read-only remount, a directory this user cannot write.

A run's writes never leave half a file where a reader takes it as whole (atomic.py: a small file by rename, a
set of files through a staging directory; checkpoint.py: a checkpoint counts once its manifest and `latest`
are written). What this module adds is the failure: a write that fails for want of storage becomes one
StorageError, a line that names the directory, what the filesystem said, the free space left there, roughly
what the write needed and what to do; train.py prints it without a traceback.

Under several ranks a failure on one rank must reach all of them: a rank that raised would otherwise leave the
others waiting at the next collective until the timeout (30 minutes). `agree` is that collective.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from zero_recipes.errors import ConfigError

CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error",
    errno.EFBIG: "file too large for the filesystem",
}


# torch's and numpy's word for a write the OS cut short: no errno comes with it; the disk filling is the usual cause
SHORT_WRITE = "a write was cut short, as when the disk fills"


class StorageError(ConfigError):
    """A write failed for want of storage. A ConfigError, so train.py prints it as one line, exits non-zero
    and keeps the traceback out of the user's way: the fix is on the machine, not in the code."""


def failure_cause(exc: BaseException) -> Optional[str]:
    """What the filesystem said, in words, when `exc` (or what it was raised from) is a failed write; None for
    anything else. torch.save's zip writer reports ENOSPC as a RuntimeError without an errno ("[enforce fail
    at inline_container.cc] unexpected pos", "PytorchStreamWriter failed writing file"), numpy's np.save as an
    errno-less OSError ("401974 requested and 319456 written"), safetensors as a SafetensorError that quotes
    the OS error's number ("os error 28"): all are read here, since nothing else would catch them."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in CAUSES:
            return CAUSES[exc.errno]
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
            return SHORT_WRITE
        if isinstance(exc, OSError) and re.search(r"\d+ requested and \d+ written", text):  # numpy's tofile
            return SHORT_WRITE
        if type(exc).__name__ == "SafetensorError" and (code := re.search(r"(?:code: |os error )(\d+)", text)):
            return CAUSES.get(int(code.group(1)), SHORT_WRITE)
        # pyarrow (datasets' cache) raises OSErrors whose errno is unset but whose text quotes it
        if isinstance(exc, OSError) and (code := re.search(r"\[errno (\d+)\]", text, re.IGNORECASE)):
            if int(code.group(1)) in CAUSES:
                return CAUSES[int(code.group(1))]
        if isinstance(exc, OSError) and "Not enough disk space" in text:  # datasets' check before it writes
            return CAUSES[errno.ENOSPC]
        exc = exc.__cause__ or exc.__context__
    return None


def nearest_existing(path: Path) -> Path:
    return next((p for p in (path, *path.parents) if p.exists()), Path("/"))


def space(path: Path) -> tuple[int, int]:
    """(free bytes this user may fill, total bytes) of the filesystem holding `path`."""
    usage = shutil.disk_usage(nearest_existing(path))
    return usage.free, usage.total


def diagnose(directory: Path, cause: str) -> str:
    """Turn an errno-less short write into what the filesystem says when asked again: a probe file
    is created and filled (64 KiB), which meets a read-only mount, a permission or a full disk."""
    if cause != SHORT_WRITE:
        return cause
    probe = nearest_existing(directory) / f".zero-recipes-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return CAUSES.get(e.errno, cause)
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return cause


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe(failure: tuple[str, str, str], needed=None, flag: str = "--output_dir") -> str:
    """'<what> failed: cannot write <directory>: <cause> (<free> free of <total>; it needs about <needed>); <fix>',
    for a `failure` as `attempt` returns it, asked once what was half-written is gone. `needed`: bytes, or a
    function giving them (asked only now); `flag`: the option that moves the write elsewhere."""
    what, directory, cause = failure[0], Path(failure[1]), failure[2]
    try:
        free, total = space(directory)
        room = f"{human(free)} free of {human(total)}"
    except OSError:
        room = "free space unknown"
    needed = needed() if callable(needed) else needed
    need = f"; it needs about {human(needed)}" if needed else ""
    return f"{what} failed: cannot write {directory}: {cause} ({room}{need}); {fix_for(cause, directory, flag)}"


def fix_for(cause: str, directory: Path, flag: str) -> str:
    if cause in (CAUSES[errno.ENOSPC], CAUSES[errno.EDQUOT], CAUSES[errno.EFBIG], SHORT_WRITE):
        return f"free space there or point {flag} at a larger disk"
    if cause == CAUSES[errno.EROFS]:
        return f"remount it read-write or point {flag} elsewhere"
    return f"make {nearest_existing(directory)} writable for this user or point {flag} elsewhere"


@contextmanager
def guarded(what: str, directory: Path, flag: str = "--output_dir"):
    """Around one process's writes (each leaves no half file: atomic.py): a storage failure becomes a StorageError
    naming `directory`, or the folder of the file the OS error names when it is elsewhere."""
    try:
        yield
    except Exception as e:
        failure = failure_of(e, what, directory)
        if failure is None:
            raise
        raise StorageError(describe(failure, flag=flag)) from None


def failure_of(exc: BaseException, what: str, directory: Path) -> Optional[tuple[str, str, str]]:
    """(what, the directory, the cause diagnosed now, while the disk is as the write left it) for a failed
    write; None when `exc` is not one."""
    cause = failure_cause(exc)
    if cause is None:
        return None
    where = Path(exc.filename).parent if isinstance(exc, OSError) and exc.filename else directory
    return what, str(where), diagnose(where, cause)


def attempt(write: Callable[[], object], what: str, directory: Path) -> Optional[tuple[str, str, str]]:
    """Run this rank's writes; a storage failure comes back as `failure_of` gives it (None: written). Anything
    else is raised: a bug is not a full disk."""
    try:
        write()
    except Exception as e:
        failure = failure_of(e, what, directory)
        if failure is None:
            raise
        return failure
    return None


def agree(failure):
    """Collective: the first rank's failure (None when every rank's writes succeeded). Every rank then takes
    the same decision, so none is left waiting at a barrier the failed rank never reaches. On the host group:
    the others may wait here while rank 0 writes a whole export."""
    import torch

    from zero_recipes.distributed.process_group import host_group

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return failure
    failures = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(failures, failure, group=host_group())
    return next((f for f in failures if f), None)


def or_warn(write: Callable[[], object], what: str, then: str, quiet: bool = False) -> bool:
    """A write whose loss costs a record, not the run (metrics.jsonl, the live eval's page): rank 0 alone makes
    it, and a rank that stopped would leave the others waiting. A storage failure prints one warning (none
    when `quiet`) and returns False; a full disk or read-only output_dir then stops every rank together at the
    next checkpoint save (checkpoint.SaveAttempt). The write itself leaves no partial file (atomic.py)."""
    try:
        write()
    except Exception as e:
        cause = failure_cause(e)
        if cause is None:
            raise
        if not quiet:
            print(f"warning: {what} not written ({cause}); {then}", file=sys.stderr, flush=True)
        return False
    return True


def check_writable(directory: Path, flag: str, given: Optional[Path] = None) -> None:
    """Refuse, before any work, a directory (or the nearest folder above it that exists, where it would be
    made) this user cannot write in: asked by creating a probe file there and removing it, since os.access
    says yes to root on a read-only mount. Hours of evaluation or cleaning are not spent to fail at the write.
    `given`: what the user passed to `flag` (a file in `directory`), named in the message."""
    import tempfile

    existing = nearest_existing(directory)
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".zero-recipes-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        cause = CAUSES.get(e.errno, e.strerror)
        raise StorageError(
            f"{flag} {given or directory}: cannot write in {existing} ({cause}); {fix_for(cause, existing, flag)}"
        ) from None
