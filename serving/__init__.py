"""jbatch serving: one engine thread behind a gRPC API (``jbatch.v1.Generation``) and an
OpenAI-compatible HTTP API, with Prometheus metrics. Start it with ``jbatch serve``."""
