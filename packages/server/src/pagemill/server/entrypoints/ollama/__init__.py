"""Ollama's native API (/api/*) over the chat and completions pipelines."""
