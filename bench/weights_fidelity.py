"""How far converted weights move the bundled model: logits vs the Q4_1 file as shipped.

For each prompt, the bundled Q4_1 model writes a greedy 64-token answer; every variant
then scores the same tokens (teacher forcing), and each position's next-token
distribution is compared with Q4_1's: top-1 agreement, KL(Q4_1 || variant) in nats,
and the largest absolute logit difference. ``f16`` (Q4_1 dequantized exactly: only the
arithmetic differs, f16 activations instead of Q4_1's 8-bit ones) is the floor.

    .venv/bin/python bench/weights_fidelity.py [--variants q8_0,q4_0,f16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ncap.engine.library import default_model_path, load_library
from ncap.engine.weights import resolve_weights

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "List three uses of a paperclip.",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat(prompt: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def f16_copy(lib: Any, source: Path, folder: Path) -> Path:
    """The Q4_1 weights dequantized to F16 (exact: each weight is m + d·q)."""
    out = folder / "f16.gguf"
    params = lib.llama_model_quantize_default_params()
    params.ftype = 1  # LLAMA_FTYPE_MOSTLY_F16
    params.allow_requantize = True
    if lib.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)):
        raise SystemExit("F16 conversion failed")
    return out


def log_softmax(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))  # type: ignore[no-any-return]


def main() -> None:
    from llama_cpp import Llama

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="q8_0,q4_0,f16")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    lib = load_library()
    source = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        files = {
            v: f16_copy(lib, source, Path(tmp))
            if v == "f16"
            else resolve_weights(lib, source, v, bundled=True, cache=Path(tmp))
            for v in args.variants.split(",")
        }

        def load(path: Path) -> Any:
            return Llama(str(path), n_ctx=1024, logits_all=True, verbose=False, n_threads=1)

        ref = load(source)
        seqs = []
        for p in PROMPTS:
            toks = ref.tokenize(chat(p).encode(), add_bos=False, special=True)
            out = ref.create_completion(toks, max_tokens=args.tokens, temperature=0.0)
            cont = ref.tokenize(out["choices"][0]["text"].encode(), add_bos=False, special=False)
            seqs.append((toks, cont))

        def scores(llm: Any, toks: list[int], cont: list[int]) -> npt.NDArray[np.float64]:
            llm.reset()
            llm.eval(toks + cont)
            return np.array(llm.scores[len(toks) - 1 : len(toks) + len(cont) - 1], np.float64)

        ref_scores = [scores(ref, *s) for s in seqs]
        for name, path in files.items():
            llm = load(path)
            agree = total = 0
            kls: list[float] = []
            diffs: list[float] = []
            for (toks, cont), r in zip(seqs, ref_scores, strict=True):
                o = scores(llm, toks, cont)
                agree += int((o.argmax(-1) == r.argmax(-1)).sum())
                total += len(cont)
                lr, lo = log_softmax(r), log_softmax(o)
                kls += list((np.exp(lr) * (lr - lo)).sum(-1))
                diffs += list(np.abs(r - o).max(-1))
            row = {
                "weights": name,
                "file_mb": round(path.stat().st_size / 1e6, 1),
                "positions": total,
                "top1_agreement": round(agree / total, 4),
                "mean_kl_nats": round(float(np.mean(kls)), 5),
                "max_kl_nats": round(float(np.max(kls)), 4),
                "mean_max_abs_logit_diff": round(float(np.mean(diffs)), 3),
            }
            print(json.dumps(row), flush=True)
            del llm


if __name__ == "__main__":
    main()
