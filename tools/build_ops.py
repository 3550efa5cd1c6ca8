"""Build DeepSpeed's JIT ops for this machine once (cached in ~/.cache/torch_extensions).

    python tools/build_ops.py

The first run of train.py builds what it needs on its own; this does it ahead of time, for CI or a
cluster image, so no rank spends minutes compiling at launch. On a CPU: shm comm (~23 s), CPU Adam
(~38 s) and, when libaio's headers are installed, async I/O for NVMe offload (~3 min). On a GPU the
same builders compile the CUDA ops instead.
"""

from __future__ import annotations

import sys
import time

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"{name}: not available here, skipped (async I/O needs libaio-dev)", flush=True)
            continue
        start = time.time()
        builder.load(verbose=False)
        print(f"{name}: ready ({time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
