"""What a run writes: checkpoints, resume, RNG state, the export, output_dir's rules, whole writes, storage faults."""
