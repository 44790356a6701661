#!/usr/bin/env bash
# Create .venv-litellm (separate from .venv, so LiteLLM's many pinned dependencies
# never touch the gateway's environment) and install the LiteLLM proxy into it.
# Idempotent: a marker file records a finished install; re-running is a no-op.
#
# Usage: scripts/setup-litellm.sh [--check]
#   --check   also start the proxy once against a stand-in upstream and send one
#             request through it (needs .venv with ncap installed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-litellm"
MARKER="$VENV/.ncap-litellm-installed"
PYTHON="${PYTHON:-python3}"
# Pinned so benchmark numbers stay comparable across runs; override to try another.
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
    exec "$ROOT/.venv/bin/python" "$ROOT/bench/litellm_check.py"
fi
