"""The OpenAI-compatible HTTP server: the API over an `EngineFront` (one engine in a thread or
a process, or replicas behind a router: `replicas.py`, `ray_engine.py`), and its metrics."""
