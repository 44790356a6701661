"""The real conversion of the bundled Q4_1 model (llama.cpp's own quantizer, < 1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine._require import require_engine

require_engine()
pytestmark = [pytest.mark.engine]

from ncap.engine.library import default_model_path, load_library  # noqa: E402
from ncap.engine.model import LlamaModel  # noqa: E402
from ncap.engine.weights import resolve_weights  # noqa: E402


def _file_type(lib: object, path: Path) -> str | None:
    model = LlamaModel(lib, path)
    try:
        return model.meta("general.file_type")
    finally:
        model.close()


def test_the_bundled_model_converts_to_a_loadable_q8_0_file(tmp_path: Path) -> None:
    lib = load_library()
    source = default_model_path()
    assert _file_type(lib, source) == "3"  # LLAMA_FTYPE_MOSTLY_Q4_1, as shipped
    out = resolve_weights(lib, source, "auto", bundled=True, threads=2, cache=tmp_path)
    assert out.parent == tmp_path and out != source
    assert _file_type(lib, out) == "7"  # LLAMA_FTYPE_MOSTLY_Q8_0
    # the 8-bit file is larger: every Q4_1 block (20 bytes) became a Q8_0 block (34)
    assert out.stat().st_size > 1.4 * source.stat().st_size
