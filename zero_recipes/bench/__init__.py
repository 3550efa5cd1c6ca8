"""The benchmarks behind `python tools/benchmark.py`, one module per benchmark, and the scripts they
launch through the deepspeed launcher (`deepspeed --module zero_recipes.bench.NAME`)."""
