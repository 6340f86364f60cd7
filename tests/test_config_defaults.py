"""One source of defaults: CLI flags of `generate`, `serve` and `bench` build
EngineConfig() when none is given, `simulate`'s build SimConfig(), each flag's help states
the default it has, EngineConfig and SimConfig take their scheduler defaults from
SchedulerConfig and build their SchedulerConfig the same way, and window_tail_allocation
means one thing."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from hybridserve.config import DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.scheduler import Scheduler
from hybridserve.entrypoints.engine_flags import add_engine_arguments, engine_config_from_args
from hybridserve.entrypoints.simulate import build_parser, sim_config_from_args
from hybridserve.sim.simulation import SimConfig
from hybridserve.testing import make_kv_cache_config


def test_engine_flags_default_to_engine_config():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert dataclasses.asdict(engine_config_from_args(p.parse_args([]))) == dataclasses.asdict(EngineConfig())


def test_simulate_flags_default_to_sim_config():
    got = sim_config_from_args(build_parser().parse_args([]), label="run")
    assert dataclasses.asdict(got) == dataclasses.asdict(SimConfig(label="run"))


SCHEDULER_SETTINGS = ("max_num_batched_tokens", "max_num_seqs", "async_scheduling", "pipeline_parallel_size",
                      "num_speculative_tokens", "enable_prefix_caching", "full_sequence_must_fit",
                      "window_tail_allocation")


def test_layers_take_scheduler_defaults_from_scheduler_config():
    sched = SchedulerConfig()
    for config in (SimConfig(), EngineConfig()):
        for name in SCHEDULER_SETTINGS:
            if not hasattr(config, name):
                continue
            if (type(config), name) == (EngineConfig, "max_num_batched_tokens"):
                # The one deliberate difference: the CPU engine's step budget (see EngineConfig).
                assert (config.max_num_batched_tokens, sched.max_num_batched_tokens) == (2048, 8192)
                continue
            assert getattr(config, name) == getattr(sched, name), (type(config).__name__, name)
    assert DEFAULT_MAX_MODEL_LEN_CAP == sched.max_model_len == 8192


def test_scheduler_config_from_settings_takes_every_shared_field():
    engine = EngineConfig(max_num_seqs=7, max_num_batched_tokens=96, async_scheduling=False,
                          num_speculative_tokens=3, enable_prefix_caching=False, window_tail_allocation=False)
    got = engine.scheduler_config(max_model_len=300)
    assert (got.max_num_seqs, got.max_num_batched_tokens, got.max_model_len, got.async_scheduling,
            got.num_speculative_tokens, got.enable_prefix_caching, got.window_tail_allocation) == \
        (7, 96, 300, False, 3, False, False)
    sim = SimConfig(max_num_seqs=5, max_num_batched_tokens=64, pipeline_parallel_size=2, full_sequence_must_fit=True)
    got = SchedulerConfig.from_settings(sim, max_model_len=1000, max_in_flight_tokens_override=77)
    assert (got.max_num_seqs, got.max_num_batched_tokens, got.pipeline_parallel_size, got.full_sequence_must_fit,
            got.max_model_len, got.max_in_flight_tokens) == (5, 64, 2, True, 1000, 77)
    # Fields a layer does not have keep SchedulerConfig's defaults.
    assert (got.policy, got.long_prefill_token_threshold) == ("fcfs", 0)


def _stated_defaults(parser: argparse.ArgumentParser):
    """(flag, the default its help states, the flag's default, its action) for every flag
    whose help says "(default: X...)"."""
    for action in parser._actions:
        text = action.help or ""
        if "%(" in text:
            text = text % {**vars(action), "prog": parser.prog}
        m = re.search(r"\(default: ([^\s,)]+)", text)
        if m is not None:
            yield action.option_strings[-1], m.group(1), action.default, action


def _states(stated: str, default, action, parser: argparse.ArgumentParser) -> bool:
    if default is None:
        return True  # the help explains what None resolves to; the config test covers the value
    if isinstance(default, bool):
        # "on"/"off", or the flag that sets this value (`--sync ... (default: --async)`).
        setters = {o for a in parser._actions if a.dest == action.dest and a.const == default for o in a.option_strings}
        return stated == ("on" if default else "off") or stated in setters
    if isinstance(default, (int, float)):
        return float(stated) == default
    return stated == default


def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p


@pytest.mark.parametrize("make_parser", [_engine_parser, build_parser], ids=["engine", "simulate"])
def test_every_flag_help_states_its_real_default(make_parser):
    parser = make_parser()
    checked = list(_stated_defaults(parser))
    assert sum(default is not None for _, _, default, _ in checked) >= 10  # the flags really were read
    wrong = [(flag, stated, default) for flag, stated, default, action in checked
             if not _states(stated, default, action, parser)]
    assert wrong == []


def test_help_check_catches_a_wrong_stated_default():
    p = argparse.ArgumentParser()
    p.add_argument("--max-num-seqs", type=int, default=128, help="requests per step (default: 256)")
    p.add_argument("--on", action=argparse.BooleanOptionalAction, default=False, help="(default: on)")
    [(_, s1, d1, a1), (_, s2, d2, a2)] = _stated_defaults(p)
    assert not _states(s1, d1, a1, p) and not _states(s2, d2, a2, p)


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
