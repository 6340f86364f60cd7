"""The embedding looked up with pread (models/loaders/file_rows.py) against the mapped view
it replaces: the same rows bit for bit (by its native reader and by its Python loop), no
file page mapped by a lookup, and named errors for an id out of range and a file cut short."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hybridserve.core.errors import ConfigError  # noqa: E402
from hybridserve.models.loaders.file_rows import FileRows, read_rows_native  # noqa: E402
from hybridserve.models.loaders.loader import load_model  # noqa: E402
from hybridserve.models.loaders.safetensors_map import MappedCheckpoint  # noqa: E402
from tests.helpers import hf_tiny  # noqa: E402

ROWS, COLS = 4096, 512  # 4 MB of bfloat16: ids far apart sit on pages far apart


def _resident_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(fields[1])
    return total


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    path = tmp_path_factory.mktemp("rows") / "table.safetensors"
    values = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # Another tensor first, so the table starts at an offset that is no multiple of a page.
    safetensors_torch.save_file({"a_first": torch.ones(3, dtype=torch.float32), "table": values}, str(path))
    return path, values


@pytest.mark.parametrize("native", [True, False])
def test_rows_read_from_the_file_equal_the_mapped_rows(table: tuple[Path, torch.Tensor], native: bool) -> None:
    """The native reader (one call a lookup) and the Python loop alike."""
    if native and read_rows_native() is None:
        pytest.skip("no C compiler: the native reader is not built")
    path, values = table
    checkpoint = MappedCheckpoint([path])
    rows = checkpoint.row_reader("table")
    ids = torch.tensor([[0, ROWS - 1, 17, 17], [4000, 1, 2, 3]])
    assert torch.equal(rows(ids, native=native), torch.nn.functional.embedding(ids, checkpoint.tensor("table")))
    assert torch.equal(rows(ids[0], native=native), values[ids[0]])
    assert torch.equal(rows(ids[:, ::2], native=native), values[ids[:, ::2]])  # strided ids
    assert rows(torch.tensor([], dtype=torch.long), native=native).shape == (0, COLS)
    for bad in (ROWS, -1):
        with pytest.raises(IndexError, match=f"index {bad} is out of range for {ROWS} rows"):
            rows(torch.tensor([3, bad, 5]), native=native)


@pytest.mark.parametrize("native", [True, False])
def test_a_file_cut_short_under_the_reader_is_a_named_error(tmp_path: Path, native: bool) -> None:
    """A row past the end of a file truncated after loading: ConfigError naming the row."""
    if native and read_rows_native() is None:
        pytest.skip("no C compiler: the native reader is not built")
    path = tmp_path / "cut.safetensors"
    values = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    safetensors_torch.save_file({"table": values}, str(path))
    rows = FileRows(path, path.stat().st_size - values.numel() * 4, (64, 8), torch.float32)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10 * 8 * 4)  # rows 54 .. 63 gone
    assert torch.equal(rows(torch.tensor([0, 53]), native=native), values[[0, 53]])
    with pytest.raises(ConfigError, match="ended inside row 60"):
        rows(torch.tensor([1, 60]), native=native)


def test_a_lookup_maps_no_page_of_the_file(table: tuple[Path, torch.Tensor]) -> None:
    path, values = table
    checkpoint = MappedCheckpoint([path])
    rows = checkpoint.row_reader("table")
    ids = torch.arange(0, ROWS, 64)
    assert torch.equal(rows(ids), values[ids])
    assert _resident_kb(path) == 0
    checkpoint.tensor("table")[ids].sum()  # the mapped view does map pages (the check can see them)
    assert _resident_kb(path) >= len(ids) * 4


def test_the_loader_looks_a_mapped_embedding_up_in_the_file() -> None:
    model = load_model(hf_tiny.tiny_model_dir("llama"))  # float32, as stored: the embedding is a view
    assert model.embed_rows is not None
    ids = torch.tensor([0, 255, 7, 7, 100])
    assert torch.equal(model.stage_input(ids, None), torch.nn.functional.embedding(ids, model.embed))
    converted = load_model(hf_tiny.tiny_model_dir("llama"), dtype=torch.bfloat16)  # a bfloat16 copy, no view
    assert converted.embed_rows is None
