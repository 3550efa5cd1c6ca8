"""The benchmarks behind `python tools/benchmark.py`, one folder per benchmark (its command's module, its report,
the probes its ranks run), and the scripts they launch through the deepspeed launcher (`deepspeed --module
bench.ROOM.NAME`, with tools/ on PYTHONPATH: common.child_env). What several benchmarks share sits at this level:
common.py (machine, ports, child processes, reports), paired.py (timing ratios with an interval) and runners/
(train.py and its baselines as each rank runs them). Not part of the installed zero_recipes package; what the
tests measure with, the allocator probe, is zero_recipes/memory/probe.py."""
