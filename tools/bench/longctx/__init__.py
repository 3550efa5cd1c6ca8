"""The long-context benchmark: per-rank peak memory against sequence length, and the longest that fits."""
