"""The OpenAI-compatible HTTP server: `AsyncEngine` (the engine in a thread), the API, metrics."""
