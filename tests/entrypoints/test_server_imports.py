"""The HTTP server process with its engine in a core process (serve's default) holds no
torch: its modules import none, and a converted GGUF's tokenizer needs no transformers
(which imports torch; tests/models/test_gguf_loader.py covers the tokenizer). torch alone
is about 200 MB of RSS in a process that only tokenizes, detokenizes and speaks HTTP. Nor
numpy (15 MB): only a GGUF's conversion, never run there, needs it."""

from __future__ import annotations

import subprocess
import sys


def test_server_front_modules_import_neither_torch_nor_numpy() -> None:
    script = ("import sys; import hybridserve.entrypoints.serve, hybridserve.engine.async_llm, "
              "hybridserve.engine.core_client, hybridserve.models.config, hybridserve.models.loaders.default_model, "
              "hybridserve.entrypoints.openai.app, hybridserve.entrypoints.openai.draining; "
              "print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
