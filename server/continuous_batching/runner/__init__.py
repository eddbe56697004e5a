"""The forward on the device: the model runner, the KV cache and its memory, CUDA graphs."""
