"""The tensor-parallelism benchmark: TP against ZeRO on the same work."""
