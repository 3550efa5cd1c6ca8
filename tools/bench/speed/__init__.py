"""The speed benchmarks: train.py against the HF Trainer and a bare DeepSpeed loop, and where a step's time goes."""
