"""One home per default: the CLI's flags are made from EngineConfig's and SimConfig's
fields, so what is left to check is that every field is reachable (or deliberately not),
that --help shows the field's own default, that a bad value fails in one line naming the
flag, and that EngineConfig and SimConfig build their SchedulerConfig the same way."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hybridserve.config import EngineConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.sched.config import SchedulerConfig
from hybridserve.core.sched.scheduler import Scheduler
from hybridserve.entrypoints import cli, engine_flags, simulate
from hybridserve.entrypoints.config_flags import flag_fields
from hybridserve.sim.config import SimConfig
from hybridserve.testing import make_kv_cache_config


def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    engine_flags.add_engine_arguments(p)
    return p


def _by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        actions.setdefault(action.dest, []).append(action)
    return actions


@pytest.mark.parametrize("config_cls, make_parser, not_flags", [
    (EngineConfig, _engine_parser, engine_flags.NOT_FLAGS),
    (SimConfig, simulate.build_parser, simulate.NOT_FLAGS),
], ids=["engine", "simulate"])
def test_every_field_is_a_flag_or_deliberately_not(config_cls, make_parser, not_flags):
    dests = _by_dest(make_parser())
    names = {f.name for f in dataclasses.fields(config_cls)}
    assert set(not_flags) <= names  # no stale exclusion
    assert sorted(names - set(not_flags) - set(dests)) == []
    assert not set(not_flags) & set(dests)


@pytest.mark.parametrize("config_cls, make_parser, skip", [
    (EngineConfig, _engine_parser, tuple(engine_flags.NOT_FLAGS)),
    (SimConfig, simulate.build_parser, (*simulate.NOT_FLAGS, *simulate.HAND_MADE_FLAGS)),
], ids=["engine", "simulate"])
def test_help_shows_the_fields_default(config_cls, make_parser, skip):
    """Formatted as --help prints it; None defaults show their note instead, if any."""
    parser = make_parser()
    dests = _by_dest(parser)
    checked = 0
    for field in flag_fields(config_cls, skip=skip):
        [action] = dests[field.name]
        text = action.help % {**vars(action), "prog": parser.prog}
        if field.default is None:
            note = field.metadata.get("default_note")
            assert note is None or f"(default: {note})" in text, (field.name, text)
            continue
        shown = {True: "on", False: "off"}.get(field.default, field.default) if isinstance(field.default, bool) \
            else f"{field.default:g}" if isinstance(field.default, float) else str(field.default)
        assert f"(default: {shown}" in text, (field.name, text)
        checked += 1
    assert checked >= 10  # the flags really were read


def test_flags_not_given_build_the_default_configs():
    assert engine_flags.engine_config_from_args(_engine_parser().parse_args([])) == EngineConfig()
    got = simulate.sim_config_from_args(simulate.build_parser().parse_args([]), label="run")
    assert got == SimConfig(label="run")


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "simulate"])
def test_a_bad_value_is_one_line_naming_the_flag_and_exit_2(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--block-size", "sixteen"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert err == f"hybridserve {command}: error: argument --block-size: invalid int value: 'sixteen'\n"


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
