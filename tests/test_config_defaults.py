"""One source of defaults: CLI flags of `generate`, `serve` and `bench` build
EngineConfig() when none is given, `simulate`'s build SimConfig(), SimConfig takes its
scheduler defaults from SchedulerConfig, and window_tail_allocation means one thing."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hybridserve.config import EngineConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.scheduler import Scheduler
from hybridserve.entrypoints.engine_flags import add_engine_arguments, engine_config_from_args
from hybridserve.entrypoints.simulate import build_parser, sim_config_from_args
from hybridserve.executor.sim.simulation import SimConfig
from hybridserve.testing import make_kv_cache_config


def test_engine_flags_default_to_engine_config():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert dataclasses.asdict(engine_config_from_args(p.parse_args([]))) == dataclasses.asdict(EngineConfig())


def test_simulate_flags_default_to_sim_config():
    got = sim_config_from_args(build_parser().parse_args([]), label="run")
    assert dataclasses.asdict(got) == dataclasses.asdict(SimConfig(label="run"))


def test_sim_config_takes_scheduler_defaults_from_scheduler_config():
    sim, sched = SimConfig(), SchedulerConfig()
    for name in ("max_num_batched_tokens", "max_num_seqs", "async_scheduling", "pipeline_parallel_size",
                 "num_speculative_tokens", "enable_prefix_caching", "full_sequence_must_fit"):
        assert getattr(sim, name) == getattr(sched, name), name


def test_window_tail_allocation_has_one_meaning():
    """None: the executor decides; True needs an executor that computes in-chunk attention
    from the batch; False is off whatever the executor."""
    def resolve(value, executor_supports):
        return SchedulerConfig(window_tail_allocation=value).resolve_window_tail(executor_supports)

    assert (resolve(None, True), resolve(None, False)) == (True, False)
    assert (resolve(True, True), resolve(False, True), resolve(False, False)) == (True, False, False)
    with pytest.raises(ConfigError, match="window_tail_allocation needs an executor"):
        resolve(True, False)
    # A scheduler built without an executor resolves the config the same way.
    with pytest.raises(ConfigError, match="window_tail_allocation needs an executor"):
        Scheduler(SchedulerConfig(window_tail_allocation=True), make_kv_cache_config(64, None, 16))
    assert Scheduler(SchedulerConfig(max_model_len=256), make_kv_cache_config(64, None, 16)).kv.window_tail is None
