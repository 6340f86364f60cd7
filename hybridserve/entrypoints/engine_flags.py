"""Engine flags shared by `generate`, `serve` and `bench`: one flag per EngineConfig field.

The flags are made from EngineConfig's fields (their help, defaults, choices and types;
see config_flags.py), and EngineConfig does the checking, so the CLI and the Python API
reject exactly the same values with the same messages.
"""

from __future__ import annotations

import argparse
import dataclasses

from hybridserve.config import EngineConfig
from hybridserve.entrypoints.config_flags import add_field_flag, config_from_args, field_help, flag_fields, flag_name
from hybridserve.entrypoints.config_flags import sections as make_sections

SECTIONS = ("model", "engine", "parallelism")
# EngineConfig fields with no flag, and why.
NOT_FLAGS = {
    "window_tail_allocation": "the executor decides; forcing it is for tests and the simulator",
}
# Short forms, as vLLM spells them.
ALIASES = {"pipeline_parallel_size": "-pp", "tensor_parallel_size": "-tp", "data_parallel_size": "-dp"}
# Two ways to size the KV pool: argparse rejects giving both before EngineConfig would.
KV_POOL_SIZE = ("kv_cache_memory", "num_blocks")


def _seed_flag(field: dataclasses.Field) -> dict:
    # Absent, --seed leaves `generate`'s requests unseeded (the engine still seeds its
    # sampler with the field's default); given, it seeds both.
    return {"default": None, "help": f"{field_help(field)}; given, generate also seeds each request with it"}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    groups = make_sections(p, SECTIONS)
    pool = groups["engine"].add_mutually_exclusive_group()
    for field in flag_fields(EngineConfig, skip=tuple(NOT_FLAGS)):
        container = pool if field.name in KV_POOL_SIZE else groups[field.metadata["section"]]
        names = (flag_name(field.name), ALIASES[field.name]) if field.name in ALIASES else ()
        overrides = _seed_flag(field) if field.name == "seed" else {}
        add_field_flag(container, EngineConfig, field, *names, **overrides)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, a)
