"""train.py and the baselines as each rank runs them, shared by several benchmarks' launches."""
