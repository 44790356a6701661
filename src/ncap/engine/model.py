"""The loaded GGUF: weights, vocabulary, token pieces and chat template.

Read-only once loaded, so the scheduler thread and request threads share it (the
llama.cpp vocabulary and model are immutable after load). Contexts are created from
it by the scheduler, which alone owns them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncap.engine.library import engine_unavailable

__all__ = ["ContextSettings", "LlamaModel"]


@dataclass(frozen=True, slots=True)
class ContextSettings:
    """How the scheduler's llama context is sized: ``n_ctx`` KV cells, unified."""

    n_ctx: int
    n_seq_max: int
    n_batch: int
    threads: int
    n_ubatch: int = 0  # 0: n_batch
    # ggml_type of the KV cache's K and V rows (1: F16, 0: F32, 8: Q8_0, 30: BF16)
    type_k: int = 1
    type_v: int = 1
    threads_batch: int = 0  # 0: threads
    flash_attn: bool = True


class LlamaModel:
    """One GGUF loaded through the low-level API (no ``llama_cpp.Llama``)."""

    def __init__(self, lib: Any, path: Path) -> None:
        self.lib = lib
        self.path = path
        params = lib.llama_model_default_params()
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise engine_unavailable(f"could not load the model {path}")
        self.vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(self._model)
        self.pieces: list[bytes] = [self._piece(t) for t in range(self.n_vocab)]
        self.eog: frozenset[int] = frozenset(
            t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(self.vocab, t)
        )
        self.chat_template: str | None = self.meta("tokenizer.chat_template")
        self.bos_text = self._text(lib.llama_vocab_bos(self.vocab))
        self.eos_text = self._text(lib.llama_vocab_eos(self.vocab))
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(self.vocab))

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when absent."""
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self.lib.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """Tokens of ``text``; special-token markup such as ``<|im_start|>`` is parsed."""
        data = text.encode("utf-8")
        size = len(data) + 8
        while True:
            buf = (ctypes.c_int32 * size)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, size, add_special, True)
            if n >= 0:
                return list(buf[:n])
            size = -n

    def new_context(self, settings: ContextSettings) -> Any:
        """A context with one unified KV cache, so one prompt's cells serve n sequences."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_ubatch or settings.n_batch
        params.n_seq_max = settings.n_seq_max
        params.kv_unified = True
        params.n_threads = settings.threads
        params.n_threads_batch = settings.threads_batch or settings.threads
        params.type_k = settings.type_k
        params.type_v = settings.type_v
        # flash attention skips masked cells: results independent of layout
        params.flash_attn_type = 1 if settings.flash_attn else 0
        params.no_perf = True
        ctx = lib.llama_init_from_model(self._model, params)
        if not ctx:
            raise engine_unavailable("could not create a llama context (out of memory?)")
        return ctx

    def close(self) -> None:
        if self._model:
            self.lib.llama_model_free(self._model)
            self._model = None

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    def _text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = self.lib.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""
