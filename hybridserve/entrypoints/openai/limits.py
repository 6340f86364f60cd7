"""What a public endpoint bounds, and who may call it: one definition of each default.

`hybridserve serve` builds its flags from these fields' defaults; the server and its
HTTP guard read the same object. Every limit exists because one request could otherwise
cost every other client: a body parsed before it is bounded, a queue that grows without
end, one request fanning out into thousands of engine requests, stop strings matched on
the engine thread for every token.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from hybridserve.core.errors import ConfigError

API_KEY_ENV = "HYBRIDSERVE_API_KEY"
# Waiting engine requests allowed per request slot of the engine (max_num_seqs) when
# --max-waiting-requests is not given: deep enough to keep every slot fed between
# arrivals, short enough that a client waits at most a few rounds of the running batch.
WAITING_PER_SEQ = 4


@dataclass(frozen=True)
class ServerLimits:
    # Request bodies larger than this are refused with 413 before they are parsed.
    max_body_bytes: int = 32 << 20
    # Engine requests (choices) waiting beyond the running batch before new requests get
    # 429; None: WAITING_PER_SEQ x max_num_seqs.
    max_waiting_requests: int | None = None
    # Engine requests one HTTP request may become: n x the number of prompts.
    max_choices_per_request: int = 128
    # Stop strings are matched on the engine thread after every token, so both bounded.
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    # On SIGTERM, in-flight requests get this long to finish before their streams end
    # with an error event.
    shutdown_timeout: float = 10.0
    # Engine rebuilds after failures before the server gives up and exits.
    max_engine_restarts: int = 3
    # Bearer key required on the API routes (None: open). /health and /metrics stay open
    # unless protect_health_and_metrics.
    api_key: str | None = None
    protect_health_and_metrics: bool = False
    # Origins allowed by CORS; empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_choices_per_request", "max_stop_strings", "max_stop_string_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_waiting_requests", "max_engine_restarts"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it unset for an open server)")

    def waiting_limit(self, max_num_seqs: int) -> int:
        if self.max_waiting_requests is not None:
            return self.max_waiting_requests
        return WAITING_PER_SEQ * max_num_seqs

    def key_matches(self, presented: str) -> bool:
        """Constant-time comparison, so response timing does not reveal the key's prefix."""
        assert self.api_key is not None
        return hmac.compare_digest(presented.encode(), self.api_key.encode())


def api_key_from_env(flag_value: str | None) -> str | None:
    """--api-key wins; else the environment variable; an empty value means none."""
    key = flag_value if flag_value is not None else os.environ.get(API_KEY_ENV)
    return key or None
