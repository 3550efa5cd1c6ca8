"""The memory estimate against real DeepSpeed runs on the CPU and against published GPU figures."""
