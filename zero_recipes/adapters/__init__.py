"""How the model is adapted for training: full fine-tuning, LoRA and QLoRA."""
