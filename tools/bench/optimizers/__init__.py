"""Muon against AdamW on the CPU: loss at equal steps, optimizer state bytes, tokens/s."""
