#!/usr/bin/env bash
# Create .venv-litellm (separate from .venv, so LiteLLM's many pinned dependencies
# never touch the gateway's environment) and install the LiteLLM proxy into it.
# Idempotent: a marker file records a finished install; re-running is a no-op.
#
# Usage: scripts/setup-litellm.sh [--check]
#   --check   also start the proxy once against the fake upstream and measure it for
#             a second (bench/gateway_bench.py --targets litellm; needs .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-litellm"
MARKER="$VENV/.ncap-litellm-installed"
PYTHON="${PYTHON:-python3}"
# Override to pin a version (e.g. LITELLM_SPEC='litellm[proxy]==1.108.7'); the installed
# version is recorded in the marker and in the gateway benchmark's result.
LITELLM_SPEC="${LITELLM_SPEC:-litellm[proxy]}"

if [[ -f "$MARKER" ]] && [[ -x "$VENV/bin/litellm" ]]; then
    echo "litellm: already installed in $VENV ($(cat "$MARKER"))"
else
    echo "litellm: creating $VENV and installing $LITELLM_SPEC (a few minutes)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "$LITELLM_SPEC"
    "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' >"$MARKER"
    echo "litellm: installed $(cat "$MARKER")"
fi

if [[ "${1:-}" == "--check" ]]; then
    exec "$ROOT/.venv/bin/python" "$ROOT/bench/gateway_bench.py" --targets litellm \
        --concurrency 1 --rounds 1 --duration 1 --warmup 0.5 --output /dev/null
fi
