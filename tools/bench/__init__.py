"""The benchmarks behind `python tools/benchmark.py`, one module per benchmark, and the scripts they launch
through the deepspeed launcher (`deepspeed --module bench.NAME`, with tools/ on PYTHONPATH: common.child_env).
Not part of the installed zero_recipes package; what the tests measure with, the allocator probe, is
zero_recipes/memory/probe.py."""
