"""What the native kernels' tests share: a kernel whose check at first use fails is refused."""

from __future__ import annotations

from typing import Any, Callable


def check_refused(monkeypatch: Any, caplog: Any, kernel_class: type, getter: Any,
                  broken_call: Callable[..., Any], message: str) -> None:
    """With kernel_class.__call__ replaced by broken_call(real_call, self, *args, **kwargs), the cached
    `getter` builds no kernel (None) and logs `message`; once undone it builds one again."""
    real = kernel_class.__call__
    monkeypatch.setattr(kernel_class, "__call__", lambda self, *args, **kwargs: broken_call(real, self, *args, **kwargs))
    getter.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert getter() is None
        assert message in caplog.text
    finally:
        monkeypatch.undo()
        getter.cache_clear()  # later tests build the kernel again
    assert getter() is not None


def step_with_and_without(monkeypatch: Any, model: Any, lengths: list[int], kernel_class: type,
                          getter_name: str) -> tuple[int, Any, Any]:
    """(how many times kernel_class ran in one prefill step of `lengths` sequences through
    `model`, that step's hidden states, the same step's with the decoder's `getter_name`
    giving no kernel: the general path)."""
    from hybridserve.models.arch import decoder as decoder_module
    from tests.helpers.int8_gemma3 import prefill

    calls = []
    real = kernel_class.__call__
    monkeypatch.setattr(kernel_class, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with_kernel = prefill(model, lengths)
    monkeypatch.setattr(decoder_module, getter_name, lambda: None)
    return len(calls), with_kernel, prefill(model, lengths)
