"""Pipeline parallelism: the axis, the Hugging Face model as DeepSpeed pipeline layers, and its step."""
