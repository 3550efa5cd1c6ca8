"""Evaluation: lm-evaluation-harness on an export or the live model, the shipped offline tasks, answers side by side."""
