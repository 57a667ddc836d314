"""KV caches: float, quantized, batched, the prompt cache."""
