"""Logprobs as the runner reports them: of sampled tokens, and of a prompt's own tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LogprobInfo:
    """Logprob of each token (sampled, or of the prompt), and the top-n alternatives at its
    position, most likely first."""

    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class PromptLogprobChunk:
    """Logprobs of the prompt tokens first_index, first_index + 1, ... (each given the
    tokens before it), computed by one step's chunk of the prompt. Prompt token 0 has none."""

    first_index: int
    info: LogprobInfo
