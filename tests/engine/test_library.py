"""The start-up check that refuses a llama.cpp build this CPU cannot run."""

from __future__ import annotations

import pytest

from ncap.engine.library import check_build
from ncap.errors import NcapError

SAFE = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | OPENMP = 1 |"
NATIVE = SAFE + " AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 |"
FLAGS = {"avx", "avx2", "f16c", "fma", "bmi2", "avx512f", "avx512_vnni", "amx_int8"}


def test_safe_build_passes() -> None:
    check_build(SAFE, FLAGS)
    check_build(SAFE, None)


def test_amx_build_is_refused_even_where_the_cpu_advertises_it() -> None:
    with pytest.raises(NcapError, match="AMX_INT8") as info:
        check_build(NATIVE, FLAGS)
    assert "GGML_NATIVE=OFF" in info.value.message


def test_feature_missing_from_the_cpu_is_refused() -> None:
    with pytest.raises(NcapError, match="AVX2"):
        check_build(SAFE, {"avx", "f16c", "fma", "bmi2"})
