"""The simulated executor (executor.py), its shadow-KV race detector (shadow_kv.py) and the
simulated offload connector (connector.py). The simulator that drives them through the
engine on a simulated clock is `hybridserve.sim`.
"""
