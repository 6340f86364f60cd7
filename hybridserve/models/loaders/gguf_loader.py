"""GGUF file -> cached Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer).

The PyTorch runner loads Hugging Face directories, so a GGUF is converted once into one and the
result is cached; every later start returns the cached directory without reading the GGUF.

Cache layout, under `$HYBRIDSERVE_CACHE_DIR` (default `~/.cache/hybridserve`):

    converted/<gguf stem>-<key>-<dtype>[-groups]-v<CONVERTER_VERSION>/
        config.json  model.safetensors  tokenizer.json  tokenizer_config.json  hybridserve-conversion.json

A `-groups` conversion (for `--quantization gguf-groups`) holds each decoder linear as the
GGUF's own int8 groups instead of its dequantized weight (gguf_groups.group_parts); the
form is part of the name, so neither mode ever reads the other's checkpoint.

Invariants:
- A directory under `converted/` with that name is complete: it is written under a temporary
  name and renamed into place as the last step (an atomic rename on one file system), so an
  interrupted conversion leaves only a `.tmp-*` folder that is never read.
- `<key>` identifies the GGUF's content, not its path: SHA-256 over the file size and 17 evenly
  spaced 64 KiB windows (head and tail included), about 1 MiB read. Hashing the whole file would
  cost a second or two per start for the default model; callers that already know a strong
  content hash (the packaged default model) pass it as `cache_key`.
- Bumping `CONVERTER_VERSION` orphans every old conversion (they are not reused). Version 2:
  a GGUF is converted to the serving dtype (bfloat16 on CPUs with native bf16), which the
  runner maps from the file as stored (models/loaders/safetensors_map.py); version 1 caches were
  always float32 and loaded by copying. Version 3: markup tokens the GGUF lists as
  user-defined (`<start_of_image>`, `[multimodal]`) are special in the tokenizer, as in
  the model's own; version 2 tokenizers let them into text.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from hybridserve.core.errors import ConfigError
from hybridserve.models.platform.cache_dir import CACHE_DIR_ENV_VAR, cache_root  # noqa: F401 - re-exported
from hybridserve.models.platform.heap import release_free_heap

if TYPE_CHECKING:  # numpy is imported by the conversion alone: the server's HTTP process reads
    import numpy as np  # this module's cache layout and marker, and never converts

CONVERTER_VERSION = 3
CONVERSION_MARKER = "hybridserve-conversion.json"
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
_KEY_WINDOW_BYTES = 64 * 1024
_KEY_WINDOW_COUNT = 17
# transformers tokenizer type (a model_type) per GGUF architecture; others get the generic class.
_TOKENIZER_TYPES = {"gemma3": "gemma3_text"}
# Rows dequantized at a time from a vocabulary-sized tensor: Gemma 3's 262k x 640 embedding
# is 671 MB in float32, and gguf's numpy dequantizer makes temporaries of a similar size.
_DEQUANTIZE_BLOCK_ROWS = 32768
# bfloat16: its raw bits; uint8: packed quantized bytes (gpt-oss's MXFP4 experts) kept as they are;
# int8: the values of int8 groups (gguf_groups.py).
_NUMPY_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "int16", "uint8": "uint8", "int8": "int8"}
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint8": "U8", "int8": "I8"}
GROUPS_SUFFIX = "-groups"  # in the cache folder's name of a conversion that keeps int8 groups


def say(progress: bool, message: str) -> None:
    """One line of first-start progress on stderr (stdout stays clean for generated text)."""
    if progress:
        print(f"hybridserve: {message}", file=sys.stderr, flush=True)


def gguf_file_key(gguf_path: Path) -> str:
    """A cheap content key for a GGUF file (see the module docstring); 16 hex digits."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with gguf_path.open("rb") as file:
        for window in range(_KEY_WINDOW_COUNT):
            file.seek(max(0, size - _KEY_WINDOW_BYTES) * window // (_KEY_WINDOW_COUNT - 1))
            digest.update(file.read(_KEY_WINDOW_BYTES))
    return digest.hexdigest()[:16]


def converted_dir(gguf_stem: str, cache_key: str, dtype: str, cache_dir: str | Path | None = None,
                  groups: bool = False) -> Path:
    """Where the conversion of a GGUF with this stem and key, in this dtype, lives (or would);
    `groups`: the form that keeps the decoder linears' int8 groups (the module docstring)."""
    safe_stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_stem)[:80] or "model"
    safe_key = re.sub(r"[^A-Za-z0-9._-]+", "_", cache_key)[:80]
    form = GROUPS_SUFFIX if groups else ""
    return cache_root(cache_dir) / "converted" / f"{safe_stem}-{safe_key}-{dtype}{form}-v{CONVERTER_VERSION}"


def find_converted(gguf_stem: str, cache_key: str, dtype: str, cache_dir: str | Path | None = None,
                   groups: bool = False) -> Path | None:
    """The cached conversion directory if it exists and is complete, else None."""
    target = converted_dir(gguf_stem, cache_key, dtype, cache_dir, groups)
    return target if (target / CONVERSION_MARKER).is_file() else None


def has_gguf_magic(path: Path) -> bool:
    """Whether the file at `path` starts with the 4 GGUF magic bytes."""
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


def convert_gguf(
    gguf_path: str | Path,
    cache_dir: str | Path | None = None,
    dtype: str = "float32",
    progress: bool = True,
    cache_key: str | None = None,
    groups: bool = False,
) -> Path:
    """Convert a GGUF file to a cached HF checkpoint directory and return that directory.

    A second call with the same file (or `cache_key`), dtype and form returns the cached
    directory after reading about 1 MiB (nothing with `cache_key`). `groups`: the decoder
    linears are kept as the file's int8 groups (--quantization gguf-groups; the module
    docstring). Raises ConfigError when the path does not exist, is not a GGUF file, or
    holds an unsupported architecture or tensor type (with `groups`, a decoder linear of a
    type that is not int8 groups).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}")
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"GGUF file does not exist: {path}")
    if not has_gguf_magic(path):
        raise ConfigError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    key = cache_key or gguf_file_key(path)
    cached = find_converted(path.stem, key, dtype, cache_dir, groups)
    if cached is not None:
        return cached
    from hybridserve.models.loaders.gguf_arch import arch_spec_for
    from hybridserve.models.loaders.gguf_header import read_gguf_header

    started = time.perf_counter()
    header = read_gguf_header(path)
    spec = arch_spec_for(header)
    if groups:
        from hybridserve.models.loaders.gguf_groups import check_group_family

        check_group_family(spec.family, header.architecture)
    config = spec.build_config(header)
    target = converted_dir(path.stem, key, dtype, cache_dir, groups)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        form = " (the decoder linears as int8 groups)" if groups else ""
        say(progress, f"first start: converting {path.name} ({header.architecture}) to a {dtype} checkpoint{form}")
        say(progress, f"caching the tensors as {dtype} safetensors in {target}, each as it is dequantized")
        _convert_tensors(header, spec, config, staging / "model.safetensors", dtype, progress, groups)
        release_free_heap()  # gguf's dequantizer temporaries, before the tokenizer is built
        (staging / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
        say(progress, "building the tokenizer from the GGUF's embedded vocabulary")
        _save_tokenizer(path, header, staging)
        release_free_heap()  # transformers' GGUF vocabulary parse, before the tokenizer is loaded again
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": str(path.resolve()),
            "source_bytes": path.stat().st_size,
            "cache_key": key,
            "architecture": header.architecture,
            "dtype": dtype,
            "int8_groups": groups,
            "conversion_seconds": round(time.perf_counter() - started, 2),
        }
        (staging / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(progress, f"converted in {time.perf_counter() - started:.1f} s; later starts load the cache")
    return target


def _publish(staging: Path, target: Path) -> None:
    """Rename the finished staging folder into place; another process finishing first wins."""
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / CONVERSION_MARKER).is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)  # an identical conversion is already published


def groups_refusal(gguf_path: str | Path) -> str:
    """'' where --quantization gguf-groups can serve the GGUF at `gguf_path` (its family and
    every decoder linear's type: what convert_gguf(groups=True) checks, read from the header
    alone), else why not, in one line."""
    from hybridserve.models.loaders.gguf_arch import arch_spec_for
    from hybridserve.models.loaders.gguf_groups import check_group_family
    from hybridserve.models.loaders.gguf_header import read_gguf_header

    try:
        header = read_gguf_header(Path(gguf_path))
        spec = arch_spec_for(header)
        check_group_family(spec.family, header.architecture)
        for tensor in spec.plan(header):
            _stored_as(tensor, "bfloat16", groups=True)
    except ConfigError as exc:
        return str(exc)
    return ""


def _convert_tensors(header: Any, spec: Any, config: dict[str, Any], path: Path, dtype: str,
                     progress: bool, groups: bool = False) -> None:
    """Every mapped tensor with HF names and llama.cpp's fix-ups undone, written in `dtype`
    to the safetensors file `path` as it is dequantized; with `groups`, the decoder linears
    as their int8 groups instead (_group_arrays).

    One tensor at a time (a vocabulary-sized one in row blocks), never the whole model: the
    shapes are known from the GGUF header, so the file's header is written first and each
    tensor's bytes follow. Holding every tensor in float32 and then a `dtype` copy for
    safetensors' writer made the default model's first start peak at 1.88 GB of RSS."""
    import numpy as np
    from tqdm import tqdm

    planned = spec.plan(header)
    stored = [_stored_as(tensor, dtype, groups) for tensor in planned]
    entries: dict[str, Any] = {}
    offset = 0
    for name, shape, kind in (output for outputs in stored for output in outputs):
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NUMPY_DTYPES[kind]).itemsize
        entries[name] = {"dtype": _SAFETENSORS_DTYPES[kind], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    # The "pt" format tag is what transformers requires to load the file.
    header_bytes = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    total_params = sum(int(np.prod(t.shape, dtype=np.int64)) for t in header.tensors)
    with path.open("wb") as file, tqdm(
        total=total_params, desc="hybridserve: dequantizing", unit="param", unit_scale=True,
        disable=not progress, file=sys.stderr, leave=False,
    ) as bar:
        file.write(len(header_bytes).to_bytes(8, "little") + header_bytes)
        for tensor, outputs in zip(planned, stored):
            if tensor.part is not None:
                blocks: Any = [np.ascontiguousarray(_packed_part(header, tensor), np.uint8)]
            elif outputs[0][0] != tensor.hf_name:  # kept as groups
                blocks = _group_arrays(header, tensor, spec, config)
            else:
                blocks = (_in_dtype(block, dtype) for block in _dequantized_blocks(header, tensor, spec, config))
            for block in blocks:
                file.write(memoryview(block).cast("B"))
            if tensor.part in (None, 0):  # a packed merge's parts share their sources: count them once
                bar.update(sum(int(np.prod(info.shape, dtype=np.int64)) for info in tensor.sources))


def _stored_as(tensor: Any, dtype: str, groups: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, stored dtype) of what one planned tensor is written as: a packed part as
    uint8; with `groups`, a decoder linear as its group parts (ConfigError where its type is
    not int8 groups); anything else in `dtype`."""
    from hybridserve.models.loaders.gguf_groups import group_parts, is_decoder_linear

    if tensor.part is not None:
        return [(tensor.hf_name, tensor.shape, "uint8")]
    if groups and tensor.merge is None and is_decoder_linear(tensor.hf_name):
        info = tensor.sources[0]
        return group_parts(tensor.hf_name, info.name, _type_name(info.ggml_type), info.ggml_type, *info.shape)
    return [(tensor.hf_name, tensor.shape, dtype)]


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def _group_arrays(header: Any, tensor: Any, spec: Any, config: dict[str, Any]) -> list[np.ndarray]:
    """A decoder linear's int8 groups (values, scale, offset where the type has one), the
    rows in the order the spec's fix-up puts them (llama's Q/K rows: gguf_groups.row_order)."""
    import numpy as np

    from hybridserve.models.loaders.gguf_groups import int8_groups, row_order
    from hybridserve.models.loaders.gguf_header import tensor_bytes

    info = tensor.sources[0]
    rows, cols = info.shape
    read = int8_groups(info.ggml_type, _type_name(info.ggml_type), tensor_bytes(header, info), rows, cols)
    order = row_order(lambda values: spec.fix_tensor(tensor.hf_name, values, config), info.name, rows)
    parts = [part for part in (read.values, read.scale, read.offset) if part is not None]
    return [np.ascontiguousarray(part if order is None else part[order]) for part in parts]


def _packed_part(header: Any, tensor: Any) -> np.ndarray:
    """One part of a packed merge (gguf_spec.BlockMerge), built from its sources' stored bytes."""
    from hybridserve.models.loaders.gguf_header import tensor_bytes

    return tensor.merge.build(*(tensor_bytes(header, info) for info in tensor.sources))[tensor.part]


def _dequantized_blocks(header: Any, tensor: Any, spec: Any, config: dict[str, Any]) -> Iterator[np.ndarray]:
    """One planned tensor (gguf_spec.PlannedTensor) as float32 with llama.cpp's changes undone:
    a merge built from its sources; a vocabulary-sized one (the embedding, the output head;
    one row per token, which fix_tensor leaves as they are) in blocks of
    _DEQUANTIZE_BLOCK_ROWS rows; any other whole (fix_tensor's per-head reordering needs all
    of a Q/K projection's rows)."""
    import numpy as np

    from hybridserve.models.loaders.gguf_header import dequantize_tensor

    if tensor.merge is not None:
        built = tensor.merge.build(*(dequantize_tensor(header, info) for info in tensor.sources))
        yield np.ascontiguousarray(built, np.float32)
        return
    info, hf_name = tensor.sources[0], tensor.hf_name
    rows = info.shape[0]
    if len(info.shape) != 2 or rows != config.get("vocab_size"):
        yield np.ascontiguousarray(spec.fix_tensor(hf_name, dequantize_tensor(header, info), config), np.float32)
        return
    for start in range(0, rows, _DEQUANTIZE_BLOCK_ROWS):
        block = dequantize_tensor(header, info, (start, min(start + _DEQUANTIZE_BLOCK_ROWS, rows)))
        yield np.ascontiguousarray(spec.fix_tensor(hf_name, block, config), np.float32)


def _in_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `values` as the stored bytes of `dtype` (bfloat16 rounded to nearest even by
    torch: numpy has no bfloat16)."""
    if dtype == "bfloat16":
        import torch

        if not values.flags.writeable:  # a view of the mapped file (an F32 tensor): torch wants writable memory
            values = values.copy()
        return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    return values.astype(_NUMPY_DTYPES[dtype], copy=False)


# GGUF token types (llama.cpp's llama_token_type).
_USER_DEFINED = 4
_MARKUP = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")


def is_markup_token(text: str) -> bool:
    """`<start_of_image>` or `[multimodal]`: one tag, no whitespace (unlike "\n\n", also user-defined)."""
    return _MARKUP.fullmatch(text) is not None


def _save_tokenizer(gguf_path: Path, header: Any, out_dir: Path) -> None:
    """Build the tokenizer from the GGUF vocabulary (`header`: its GGUFHeader) with transformers and
    save it to `out_dir`.

    transformers is pointed at a folder holding only a link to the GGUF: a tokenizer.json that
    happens to sit next to the GGUF would otherwise take precedence over the embedded vocabulary.
    `tokenizer_type` is passed so transformers does not parse the whole GGUF a second time to find
    the model type (about 24 s on a 262k vocabulary).

    transformers marks only the GGUF's control tokens special. GGUFs list some of a model's
    special tokens as user-defined (Gemma 3's image markers), and the model's own tokenizer
    has them special: those that are markup are made special here, so they never reach
    text (`skip_special_tokens`).
    """
    architecture = header.architecture
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError("building a tokenizer from a GGUF needs transformers: pip install 'hybridserve[gemma]'") \
            from None
    source_dir = out_dir / ".gguf-source"
    source_dir.mkdir()
    try:
        (source_dir / gguf_path.name).symlink_to(gguf_path.resolve())
    except OSError:  # no symlinks (some Windows setups): use the GGUF's own folder
        source_dir.rmdir()
        source_dir = gguf_path.parent
    try:
        common: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
        tokenizer_type = _TOKENIZER_TYPES.get(architecture)
        if tokenizer_type is not None:
            tokenizer = AutoTokenizer.from_pretrained(str(source_dir), tokenizer_type=tokenizer_type, **common)
        else:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source_dir), **common)
    finally:
        if source_dir != gguf_path.parent:
            shutil.rmtree(source_dir)
    types = header.metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        from tokenizers import AddedToken

        markup = [t.content for i, t in tokenizer.added_tokens_decoder.items()
                  if not t.special and i < len(types) and types[i] == _USER_DEFINED and is_markup_token(t.content)]
        if markup:
            tokenizer.add_tokens([AddedToken(c, special=True, normalized=False) for c in markup], special_tokens=True)
    tokenizer.save_pretrained(str(out_dir))
