"""Converted weights: cached by source content, type and llama version; written atomically."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

from ncap.engine.weights import CACHE_ENV, cache_dir, resolve_weights
from ncap.errors import NcapError


class _Params(ctypes.Structure):
    _fields_ = [
        ("nthread", ctypes.c_int32),
        ("ftype", ctypes.c_int),
        ("output_tensor_type", ctypes.c_int),
        ("allow_requantize", ctypes.c_bool),
    ]


class FakeLib:
    """``llama_model_quantize`` that writes the source's bytes and the ftype, or fails."""

    def __init__(self, rc: int = 0) -> None:
        self.rc = rc
        self.calls: list[tuple[str, str, int, int, bool]] = []

    def llama_model_quantize_default_params(self) -> _Params:
        return _Params(nthread=0, ftype=0, output_tensor_type=39, allow_requantize=False)

    def llama_model_quantize(self, src: bytes, dst: bytes, params: Any) -> int:
        p = params._obj
        self.calls.append(
            (src.decode(), dst.decode(), p.ftype, p.output_tensor_type, p.allow_requantize)
        )
        if self.rc:
            Path(dst.decode()).write_bytes(b"half written")
            return self.rc
        Path(dst.decode()).write_bytes(Path(src.decode()).read_bytes() + bytes([p.ftype]))
        return 0


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "Model.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF source weights")
    return path


def test_original_and_auto_for_a_model_path_load_the_file_itself(
    source: Path, tmp_path: Path
) -> None:
    lib, cache = FakeLib(), tmp_path / "cache"
    assert resolve_weights(lib, source, "original", bundled=True, cache=cache) == source
    assert resolve_weights(lib, source, "auto", bundled=False, cache=cache) == source
    assert lib.calls == [] and not cache.exists()


def test_auto_for_the_bundled_model_converts_once_to_q8_0(source: Path, tmp_path: Path) -> None:
    lib, cache = FakeLib(), tmp_path / "cache"
    first = resolve_weights(lib, source, "auto", bundled=True, threads=2, cache=cache)
    again = resolve_weights(lib, source, "q8_0", bundled=True, threads=2, cache=cache)
    assert first == again and first.parent == cache
    assert first.read_bytes() == b"GGUF source weights" + bytes([7])  # LLAMA_FTYPE_MOSTLY_Q8_0
    assert len(lib.calls) == 1
    src, _dst, ftype, _out, requantize = lib.calls[0]
    assert (src, ftype, requantize) == (str(source), 7, True)
    assert "q8_0" in first.name and "Model.Q4_1" in first.name
    assert [p.name for p in cache.iterdir()] == [first.name]  # no temp file left behind
    assert first.stat().st_mode & 0o044 == 0o044  # readable by others, like the source


def test_q4_0_keeps_the_tied_embedding_at_q8_0(source: Path, tmp_path: Path) -> None:
    lib = FakeLib()
    out = resolve_weights(lib, source, "q4_0", bundled=True, cache=tmp_path / "c")
    assert lib.calls[0][2:4] == (2, 8)  # LLAMA_FTYPE_MOSTLY_Q4_0, GGML_TYPE_Q8_0
    assert "q4_0" in out.name


def test_a_changed_source_gets_its_own_conversion(source: Path, tmp_path: Path) -> None:
    lib, cache = FakeLib(), tmp_path / "cache"
    first = resolve_weights(lib, source, "q8_0", bundled=True, cache=cache)
    source.write_bytes(b"GGUF other weights!")  # same name and size, other content
    second = resolve_weights(lib, source, "q8_0", bundled=True, cache=cache)
    assert first != second and len(lib.calls) == 2
    assert second.read_bytes() == b"GGUF other weights!" + bytes([7])


def test_a_failed_conversion_leaves_nothing_and_says_what_to_do(
    source: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(NcapError) as err:
        resolve_weights(FakeLib(rc=1), source, "q8_0", bundled=True, cache=cache)
    assert err.value.code == "engine_unavailable" and "original" in err.value.message
    assert list(cache.iterdir()) == []
    # the next start tries again rather than loading a half-written file
    lib = FakeLib()
    resolve_weights(lib, source, "q8_0", bundled=True, cache=cache)
    assert len(lib.calls) == 1


def test_unknown_weights_is_refused(source: Path, tmp_path: Path) -> None:
    with pytest.raises(NcapError, match="unknown weights 'q2_k'"):
        resolve_weights(FakeLib(), source, "q2_k", bundled=True, cache=tmp_path)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "models"))
    assert cache_dir() == tmp_path / "models"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ncap" / "models"
