"""tools/benchmark.py dpo: train.py's DPO against TRL's DPOTrainer (benchmark.py)."""
