"""A config's explicit `layer_types` list, checked against the layer kinds its family has
(shared by the hybrid families' config parsers)."""

from __future__ import annotations

from typing import Any

from hybridserve.core.errors import ConfigError


def checked_layer_types(given: list[Any], num_layers: int, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """`given` as a tuple; ConfigError unless it has one entry a layer, each one of `kinds`."""
    if len(given) != num_layers:
        raise ConfigError(f"layer_types has {len(given)} entries for {num_layers} layers")
    bad = sorted({str(t) for t in given if t not in kinds})
    if bad:
        raise ConfigError(f"unsupported layer type(s) {bad} in layer_types (supported: {', '.join(kinds)})")
    return tuple(given)
