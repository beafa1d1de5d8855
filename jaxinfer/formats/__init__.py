"""Checkpoint formats: Hugging Face folders and GGUF files -> config, tokenizer and tensors."""
