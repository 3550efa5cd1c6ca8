"""The LoRA benchmark: LoRA against full fine-tuning of the same base."""
