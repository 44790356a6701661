#!/usr/bin/env bash
# Install Portkey's open-source gateway (@portkey-ai/gateway, pinned in
# bench/portkey/package.json) into bench/portkey/node_modules for the gateway benchmark.
# Needs node and npm. Idempotent: an installed copy of the pinned version is kept.
#
# Usage: scripts/setup-portkey.sh [--check]
#   --check   also start it once against the fake upstream and measure it for a second
#             (bench/gateway_bench.py --targets portkey; needs .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="$ROOT/bench/portkey"
BIN="$DIR/node_modules/.bin/gateway"

if ! command -v npm >/dev/null; then
    echo "portkey: npm not found; install Node.js 18+ to benchmark Portkey" >&2
    exit 1
fi
if [[ -x "$BIN" ]] && (cd "$DIR" && npm ls --depth=0 @portkey-ai/gateway >/dev/null 2>&1); then
    echo "portkey: already installed in $DIR/node_modules"
else
    echo "portkey: installing @portkey-ai/gateway into $DIR/node_modules"
    # the lock file pins every transitive version; the published package ships no
    # patches/ directory, so its postinstall (patch-package) has nothing to apply
    (cd "$DIR" && npm ci --no-audit --no-fund --ignore-scripts)
fi

if [[ "${1:-}" == "--check" ]]; then
    exec "$ROOT/.venv/bin/python" "$ROOT/bench/gateway_bench.py" --targets portkey \
        --concurrency 1 --rounds 1 --duration 1 --warmup 0.5 --output /dev/null
fi
