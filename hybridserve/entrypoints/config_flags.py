"""CLI flags generated from a config dataclass's fields, so each default has one home.

A field becomes a flag through its metadata:
- "help" (required): what the setting does;
- "default_note" (optional): what the default means, shown after the default's value,
  or instead of it where the default is None ("the model's");
- "section": the --help group it is listed in;
- "choices", "metavar": as in argparse.

Invariants: the flag's dest is the field's name, its default is the field's default and its
help shows that default (`(default: VALUE[, NOTE])`), rendered from the field, never
written out again; its type comes from the annotation (int, float, str, a size given as
bytes or "2GiB", a bool as --flag / --no-flag). `config_from_args` builds the config
from the flags a parser has, leaving out a flag left at None so the field's default
applies.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Iterator, Mapping, Sequence

_NO_DEFAULT = dataclasses.MISSING


def flag_name(name: str) -> str:
    """The long option of a field: `max_num_seqs` -> `--max-num-seqs`."""
    return "--" + name.replace("_", "-")


def _default(field: dataclasses.Field) -> Any:
    if field.default is not _NO_DEFAULT:
        return field.default
    if field.default_factory is not _NO_DEFAULT:
        return field.default_factory()
    return None


def render_default(value: Any) -> str:
    """A default as --help shows it: booleans as on/off, numbers without a trailing .0."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def field_help(field: dataclasses.Field) -> str:
    """The field's help with its default: "tokens per KV block (default: 16)"."""
    text = field.metadata["help"]
    note = field.metadata.get("default_note")
    value = _default(field)
    shown = note if value is None else render_default(value) + (f", {note}" if note else "")
    return f"{text} (default: {shown})" if shown else text


def _parse_size(text: str) -> int | str:
    # Bytes as an int; "2GiB" stays text for the config's own size parser and its error.
    return int(text) if text.isdigit() else text


def _flag_type(annotation: Any) -> dict[str, Any]:
    """argparse keywords for an annotation: a type, or the --flag / --no-flag action."""
    kinds = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) else {annotation}
    kinds.discard(type(None))
    if kinds == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if kinds == {int, str}:
        return {"type": _parse_size, "metavar": "SIZE"}
    if len(kinds) == 1 and next(iter(kinds)) in (int, float, str):
        return {"type": next(iter(kinds))}
    raise TypeError(f"no flag type for the annotation {annotation!r}")


def flag_fields(config_cls: type, skip: Sequence[str] = ()) -> Iterator[dataclasses.Field]:
    """The fields of `config_cls` that are flags: all but `skip`, each with its help.

    A field with no help that is not skipped is a mistake of the code (a new setting the
    CLI would silently lack), so it raises rather than being left out."""
    for field in dataclasses.fields(config_cls):
        if field.name in skip:
            continue
        if "help" not in field.metadata:
            raise TypeError(f"{config_cls.__name__}.{field.name} has no help: give it metadata={{'help': ...}} "
                            f"or leave it out of the flags deliberately")
        yield field


def add_field_flag(container: Any, config_cls: type, field: dataclasses.Field, *option_strings: str,
                   **overrides: Any) -> argparse.Action:
    """Add `field` of `config_cls` to a parser, group or exclusive group as one flag.

    `option_strings` replace the default `--field-name` (e.g. to add `-pp`); `overrides`
    replace argparse keywords, such as a default of None for a flag whose absence means
    more than the field's default (the field's default still applies, see
    `config_from_args`)."""
    hints = typing.get_type_hints(config_cls)
    kwargs: dict[str, Any] = {"dest": field.name, "default": _default(field), "help": field_help(field).replace(
        "%", "%%"), **_flag_type(hints[field.name])}
    for key in ("choices", "metavar"):
        if key in field.metadata:
            kwargs[key] = field.metadata[key]
    kwargs.update(overrides)
    return container.add_argument(*(option_strings or (flag_name(field.name),)), **kwargs)


def config_from_args(config_cls: type, args: argparse.Namespace, **settings: Any) -> Any:
    """`config_cls` from every field the parsed flags have (None: the field's default),
    with `settings`, which the command resolves itself, taking precedence."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    return config_cls(**{**{name: v for name, v in values.items() if v is not None}, **settings})


def sections(parser: argparse.ArgumentParser, titles: Sequence[str]) -> Mapping[str, Any]:
    """One --help group per section title, in this order."""
    return {title: parser.add_argument_group(title) for title in titles}
