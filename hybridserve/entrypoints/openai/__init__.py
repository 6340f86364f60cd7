"""The OpenAI-compatible HTTP server: its app, routes, protocol, limits, metrics and drain.

The CLI command that starts it (`hybridserve serve`) stays one level up, in entrypoints/.
"""
