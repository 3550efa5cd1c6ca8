"""Build DeepSpeed's JIT ops for this machine once (cached in ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR).

    python tools/build_ops.py

The first run of train.py builds what it needs on its own, saying so; this does it ahead of time, for CI or a
cluster image, so no rank spends minutes compiling at launch. It builds every op a train.py run may load here
(zero_recipes/ds/jit_ops.py says which config loads which). On a CPU: shm comm (~28 s on 2 cores), CPU Adam (~43 s),
fused Adam for DeepSpeed configs with an `optimizer` block (~97 s) and, when libaio's headers are installed,
pinned memory and async I/O for NVMe offload (~3 min). On a GPU the same builders compile the CUDA ops instead.

A build folder left locked or half-built by an interrupted build is checked as train.py checks it: a lock no
process can hold is removed and the op rebuilt, saying so; one it cannot tell about is one `error:` line, exit 2.
Then each op is loaded, so ninja also rebuilds what a DeepSpeed upgrade changed.
"""

from __future__ import annotations

import sys
import time

from zero_recipes.ds import jit_ops
from zero_recipes.errors import ConfigError

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")


def main(argv: list[str] | None = None) -> int:
    builders = {type(b).__name__: b for b in jit_ops.jit_builders(list(OPS))}
    try:
        for name in OPS:
            if name not in builders:
                print(
                    f"{name}: not built here (prebuilt into DeepSpeed, or not for this machine: async I/O "
                    "needs libaio-dev), skipped",
                    flush=True,
                )
                continue
            start = time.time()
            jit_ops.settle([builders[name]], say=lambda line: print(line, flush=True))
            builders[name].load(verbose=False)  # ninja rebuilds what a DeepSpeed upgrade changed; a bad .so shows
            folder = jit_ops.build_folder(builders[name])
            print(f"{name}: ready in {folder} ({time.time() - start:.0f} s)", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
