"""The DeepSpeed config: fragments merged, every "auto" filled, DeepSpeed's own schema and checks, its JIT-built ops."""
