"""The DeepSpeed settings benchmark: overlap_comm and bucket sizes, with a loss-parity check each."""
