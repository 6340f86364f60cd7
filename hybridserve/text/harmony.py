"""Reading a reply written in harmony, gpt-oss's chat format, from its token ids.

A harmony reply is a run of messages, each `<|start|>{header}<|message|>{body}` closed by
`<|end|>` (more follows), `<|call|>` (a tool call: the reply stops for its result) or
`<|return|>` (the reply is done). The header holds the author (`assistant`), the channel
after `<|channel|>` (`analysis`: reasoning; `final`: the answer; `commentary`: tool calls
and preambles), an optional recipient `to=functions.NAME` (in the author part or after
the channel) and an optional content type after `<|constrain|>` or the channel (`json`).
The chat prompt ends in `<|start|>assistant` (gpt-oss's template), so a reply opens
inside its first header; a template that ends further in (`...<|channel|>final<|message|>`)
is read the same way: the parser starts from the prompt's last `<|start|>`.

`HarmonyParser` reads the token ids as they arrive and says what each step adds, as
`Piece`s: reasoning text, content text, or a tool call's name and then its argument text.
Invariants: the control tokens never reach any text; the pieces of one kind, joined, are
that kind's text of the whole reply however the ids were split across pushes; a header
is only read whole (at `<|message|>`), so a piece's kind is known when it is given; text
outside any message (a header cut off by max_tokens, text after `<|end|>` without a new
`<|start|>`) is dropped.

Routing: a message with a recipient is a tool call named by it (`functions.` dropped),
whatever its channel; `analysis` is reasoning; every other channel (`final`, a
`commentary` preamble, one the format may add later) is content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Sequence

from hybridserve.text.tokenizer import IncrementalDetokenizer, Tokenizer

# The control tokens a harmony tokenizer has as single special tokens (o200k_harmony's).
CONTROL_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
FUNCTIONS_NAMESPACE = "functions."
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+)")

PieceKind = Literal["reasoning", "content", "tool_call"]


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of a tokenizer's harmony control tokens."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> HarmonyTokens | None:
        """The tokenizer's harmony tokens, or None when it lacks any of them (not a harmony model)."""
        if tokenizer is None:
            return None
        ids = [tokenizer.special_token_id(name) for name in CONTROL_TOKENS]
        if any(i is None for i in ids):
            return None
        return cls(*ids)  # type: ignore[arg-type]


@dataclass
class Piece:
    """What one push added to one part of the reply. A tool call's first piece carries its
    `name` (and possibly no text yet); later pieces of the same call carry argument text."""

    kind: PieceKind
    text: str
    call_index: int | None = None
    name: str | None = None


@dataclass
class HarmonyReply:
    """A whole reply: its reasoning, its content and its tool calls as (name, arguments text)."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)

    def add(self, pieces: list[Piece]) -> HarmonyReply:
        for p in pieces:
            if p.kind == "reasoning":
                self.reasoning += p.text
            elif p.kind == "content":
                self.content += p.text
            elif p.name is not None:
                self.calls.append((p.name, p.text))
            else:
                name, args = self.calls[p.call_index]  # type: ignore[index]
                self.calls[p.call_index] = (name, args + p.text)  # type: ignore[index]
        return self


class HarmonyParser:
    """Token ids of one reply in, `Piece`s out (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, tokens: HarmonyTokens, prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.in_body = False
        self.in_header = True  # the prompt opened the first header (`<|start|>assistant`)
        self.header: dict[str, list[int]] = {"author": [], "channel": [], "constrain": []}
        self.section = "author"
        self.kind: PieceKind = "content"
        self.call_index: int | None = None
        self.num_calls = 0
        self.body: IncrementalDetokenizer | None = None
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            if prompt_token_ids[i] == tokens.start:  # the reply continues the prompt's last message
                self.push(list(prompt_token_ids[i:]))
                break

    def push(self, token_ids: list[int]) -> list[Piece]:
        pieces: list[Piece] = []
        t = self.tokens
        for token in token_ids:
            if token == t.start:
                self._close_body(pieces)
                self._open_header()
            elif token in (t.end, t.call, t.return_):
                self._close_body(pieces)
                self.in_header = False
            elif token == t.message:
                if self.in_header:
                    self._open_body(pieces)
            elif token == t.channel:
                if not self.in_body:  # a header without `<|start|>` (lenient): read it as one
                    if not self.in_header:
                        self._open_header()
                    self.section = "channel"
            elif token == t.constrain:
                if self.in_header:
                    self.section = "constrain"
            elif self.in_body:
                self._emit(pieces, self.body.push([token]))  # type: ignore[union-attr]
            elif self.in_header:
                self.header[self.section].append(token)
        return pieces

    def finish(self) -> list[Piece]:
        """What the body's detokenizer still holds (the reply ended mid-message)."""
        pieces: list[Piece] = []
        self._close_body(pieces)
        return pieces

    def parse(self, token_ids: list[int]) -> HarmonyReply:
        """A whole reply at once."""
        return HarmonyReply().add(self.push(token_ids) + self.finish())

    # -- states -------------------------------------------------------------------------
    def _open_header(self) -> None:
        self.in_header, self.in_body = True, False
        self.header = {"author": [], "channel": [], "constrain": []}
        self.section = "author"

    def _open_body(self, pieces: list[Piece]) -> None:
        text = {key: self.tokenizer.decode(ids) for key, ids in self.header.items()}
        found = _RECIPIENT.search(text["author"]) or _RECIPIENT.search(text["channel"])
        channel = (text["channel"].split() or [""])[0]
        self.in_header, self.in_body = False, True
        self.body = self.tokenizer.detokenizer([])
        self.call_index = None
        if found is not None:
            name = found.group(1).removeprefix(FUNCTIONS_NAMESPACE)
            self.kind, self.call_index = "tool_call", self.num_calls
            self.num_calls += 1
            pieces.append(Piece("tool_call", "", call_index=self.call_index, name=name))
        else:
            self.kind = "reasoning" if channel == "analysis" else "content"

    def _close_body(self, pieces: list[Piece]) -> None:
        if self.in_body and self.body is not None:
            self._emit(pieces, self.body.finish())
        self.in_body = False
        self.body = None

    def _emit(self, pieces: list[Piece], text: str) -> None:
        if text:
            pieces.append(Piece(self.kind, text, call_index=self.call_index))
