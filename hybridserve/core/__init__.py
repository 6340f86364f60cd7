"""The pure-Python core: KV cache management, requests and scheduling.

Nothing under `hybridserve.core` imports torch; executors, models and servers live outside.
"""
