"""Named exceptions. Library users catch these; the CLI and server turn them into one line."""


class HybridServeError(Exception):
    """Base of every error hybridserve raises on purpose."""


class ConfigError(HybridServeError, ValueError):
    """An engine, model or KV cache setting is invalid."""


class BlockPoolError(HybridServeError, RuntimeError):
    """The block pool was asked to do something impossible (double free, null block free)."""


class OutOfBlocksError(BlockPoolError):
    """More blocks were requested than are free."""


class RequestError(HybridServeError, ValueError):
    """A request is malformed (duplicate id, empty prompt, unknown id in an output).

    `param` names the request field at fault, when there is one (servers report it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def one_line(exc: BaseException) -> str:
    """An exception as one log line: its type and its message's first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
