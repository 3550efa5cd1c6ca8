"""The GPU benchmark: one prepared script that measures everything on one H100/H200."""
