"""The simulator: the real scheduler and engine loop on a simulated clock, driven by a
workload, timed by a cost model of GPU presets, and summarised in a report.

Above the engine. The simulated executor it runs and its shadow-KV race detector live in
`hybridserve.executor.sim`.
"""
