"""Time train.py's per-step preemption check on its own: StopRequest.agreed() in a real 2-rank world.

PYTHONPATH=tools deepspeed --num_gpus 2 --module bench.settings.stop_probe OUT.json CALLS
"""

import json
import statistics
import sys
import time
from pathlib import Path

from zero_recipes.distributed import launcher_env, preemption, process_group


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    out, calls = Path(args[0]), int(args[1])
    ranks = launcher_env.rank_info()
    rank = ranks.rank
    launcher_env.set_threads(ranks.local_world_size)
    process_group.init()
    stop = preemption.StopRequest()
    seconds = []
    for _ in range(calls):
        t = time.perf_counter()
        assert stop.agreed() is None
        seconds.append(time.perf_counter() - t)
    if rank == 0:
        out.write_text(json.dumps({"median_seconds": statistics.median(seconds[calls // 10 :]), "calls": calls}))
    process_group.finish(0)


if __name__ == "__main__":
    main()
