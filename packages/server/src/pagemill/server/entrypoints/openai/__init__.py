"""The OpenAI-compatible HTTP API: routes, request and response types, validation at the edge."""
