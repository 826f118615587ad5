"""Models and their weights: architectures, layers, quantized formats, loading (safetensors,
GGUF, the Hub)."""
