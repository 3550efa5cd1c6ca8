"""One training run: the DeepSpeed engine, one step (the runner), fit(), the LR schedule, metrics, warnings."""
