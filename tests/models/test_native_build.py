"""native_build: the compiler flags per CPU, the per-machine cache, and failures named."""

from __future__ import annotations

import shutil

import pytest

from hybridserve.models.platform import native_build
from hybridserve.models.platform.cache_dir import CACHE_DIR_ENV_VAR
from hybridserve.models.platform.native_build import NativeBuildError, build, isa_flags

ADD = "int add(int a, int b) { return a + b; }\n"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


def test_isa_flags_follow_the_cpu() -> None:
    assert isa_flags(frozenset({"avx512f", "avx2", "fma", "sse2"}), "x86_64") == ("-mavx512f", "-mavx2", "-mfma")
    assert isa_flags(frozenset({"avx2", "fma"}), "x86_64") == ("-mavx2", "-mfma")
    assert isa_flags(frozenset({"avx512f", "avx2"}), "x86_64") == ()  # no FMA: the baseline
    assert isa_flags(frozenset({"sse2"}), "x86_64") == ()
    assert isa_flags(frozenset({"avx512f", "avx2", "fma"}), "aarch64") == ()
    zen4 = frozenset({"avx512f", "avx512bw", "avx512_bf16", "avx2", "fma"})
    assert isa_flags(zen4, "x86_64") == ("-mavx512f", "-mavx2", "-mfma", "-mavx512bf16")
    assert isa_flags(zen4 - {"avx512bw"}, "x86_64") == ("-mavx512f", "-mavx2", "-mfma")
    assert isa_flags(zen4 | {"avx512_vnni"}, "x86_64") == ("-mavx512f", "-mavx2", "-mfma", "-mavx512bf16",
                                                          "-mavx512vnni")
    assert isa_flags(zen4 | {"avx512_vnni", "avx512vbmi"}, "x86_64") == ("-mavx512f", "-mavx2", "-mfma",
                                                                         "-mavx512bf16", "-mavx512vnni",
                                                                         "-mavx512vbmi")
    assert isa_flags(frozenset({"avx2", "fma", "avx512_vnni"}), "x86_64") == ("-mavx2", "-mfma")  # no AVX-512F


def test_a_flag_the_compiler_refuses_is_dropped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(native_build, "_accepts", lambda cc, flag: flag != "-mavx512bf16")
    assert native_build._accepted("cc", ("-mavx512f", "-mavx512bf16")) == ("-mavx512f",)
    monkeypatch.setattr(native_build, "_accepts", lambda cc, flag: True)
    assert native_build._accepted("cc", ("-mavx512f", "-mavx512bf16")) == ("-mavx512f", "-mavx512bf16")


@needs_cc
def test_the_probe_refuses_a_flag_no_compiler_knows() -> None:
    cc = shutil.which("cc")
    assert native_build._accepts(cc, "-mno-such-extension-anywhere") is False
    assert native_build._accepts(cc, "-O2") is True


@pytest.fixture
def cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(CACHE_DIR_ENV_VAR, str(tmp_path / "cache"))
    return tmp_path / "cache" / "native"


@needs_cc
def test_built_once_then_loaded_from_the_cache(tmp_path, cache) -> None:  # type: ignore[no-untyped-def]
    source = tmp_path / "add.c"
    source.write_text(ADD)
    assert build("add", source).add(2, 3) == 5
    (built,) = cache.iterdir()
    stamp = built.stat().st_mtime_ns
    assert build("add", source).add(40, 2) == 42
    assert [p.name for p in cache.iterdir()] == [built.name] and built.stat().st_mtime_ns == stamp
    source.write_text(ADD + "int sub(int a, int b) { return a - b; }\n")  # an edit builds anew
    assert build("add", source).sub(5, 3) == 2
    assert len(list(cache.iterdir())) == 2


@needs_cc
def test_a_failed_build_is_one_named_line(tmp_path, cache) -> None:  # type: ignore[no-untyped-def]
    source = tmp_path / "broken.c"
    source.write_text("int add(int a, int b) { return a + ; }\n")
    with pytest.raises(NativeBuildError, match=r"failed on broken\.c: .*error") as info:
        build("broken", source)
    assert "\n" not in str(info.value)
    assert not list(cache.iterdir())  # no half-written library left behind


def test_no_compiler_is_named(tmp_path, cache, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(native_build.CC_ENV, "no-such-cc-here")
    source = tmp_path / "add.c"
    source.write_text(ADD)
    with pytest.raises(NativeBuildError, match="no C compiler: 'no-such-cc-here' is not on PATH"):
        build("add", source)


def test_a_cache_folder_that_cannot_be_made_is_named(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV_VAR, str(blocker))  # the cache root is a file: no folder below it
    monkeypatch.setattr(native_build, "_compiler", lambda: "cc")
    monkeypatch.setattr(native_build, "_compiler_version", lambda cc: "cc 1.0")
    source = tmp_path / "add.c"
    source.write_text(ADD)
    with pytest.raises(NativeBuildError, match="cannot create the cache folder"):
        build("add", source)


@needs_cc
def test_the_shared_header_is_on_the_path_and_in_the_digest(tmp_path, cache, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    include = tmp_path / "include"
    include.mkdir()
    (include / "shared.h").write_text("#define OFFSET 10\n")
    monkeypatch.setattr(native_build, "INCLUDE_DIR", include)
    source = tmp_path / "plus.c"
    source.write_text('#include "shared.h"\nint plus(int a) { return a + OFFSET; }\n')
    assert build("plus", source).plus(1) == 11
    (include / "shared.h").write_text("#define OFFSET 20\n")  # a header edit builds anew
    assert build("plus", source).plus(1) == 21
    assert len(list(cache.iterdir())) == 2


def test_checked_gives_the_kernel_or_none_with_a_warning(caplog) -> None:  # type: ignore[no-untyped-def]
    assert native_build.checked(lambda: "kernel", lambda k: "", "the general path") == "kernel"

    def no_compiler() -> str:
        raise NativeBuildError("no C compiler: 'cc' is not on PATH")

    with caplog.at_level("WARNING"):
        assert native_build.checked(no_compiler, lambda k: "", "x stays eager") is None
        assert native_build.checked(lambda: "kernel", lambda k: "gives wrong outputs", "y gathers") is None
    assert "x stays eager: the native kernel is not used (no C compiler: 'cc' is not on PATH)" in caplog.text
    assert "y gathers: the native kernel is not used (gives wrong outputs)" in caplog.text
