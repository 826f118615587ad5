"""Anthropic's Messages API (POST /v1/messages) over the chat pipeline."""
