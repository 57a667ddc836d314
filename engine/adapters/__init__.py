"""LoRA adapters: layers, mounting at inference time, the registry."""
