"""Weights, tokenizers and the models known by name: GGUF and Hugging Face loaders, the catalog."""
