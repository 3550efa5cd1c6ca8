"""The pipeline-parallelism benchmark: PP2 against ZeRO, and the pipeline bubble."""
