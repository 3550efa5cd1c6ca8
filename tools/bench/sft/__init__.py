"""The SFT benchmark: train.py against TRL's SFTTrainer and the HF Trainer on the same conversations."""
