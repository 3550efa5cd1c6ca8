"""Preference optimisation (DPO and relatives): data, losses, the reference, the runner."""
