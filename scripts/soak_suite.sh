#!/usr/bin/env bash
# Flakiness check: the whole suite N times in a row with a CPU-bound process
# running beside it. Usage: scripts/soak_suite.sh N [extra pytest args...]
# Runs from the repository root with this checkout's sources first on the path, using
# .venv (or $PYTHON). Prints one line per round (pass/fail, counts, seconds, load) and
# exits non-zero if any round failed; each round's output is kept in $SOAK_DIR.
set -u
rounds="${1:?usage: scripts/soak_suite.sh N [pytest args...]}"
shift
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
dir="${SOAK_DIR:-$(mktemp -d -t ncap-soak.XXXXXX)}"
mkdir -p "$dir"

"$python" -c 'while True: pass' &
burner=$!
trap 'kill "$burner" 2>/dev/null' EXIT
echo "soak: $rounds rounds, CPU burner pid $burner, logs in $dir, $(nproc) cores"

failed=0
for round in $(seq 1 "$rounds"); do
  log="$dir/round-$round.log"
  start=$(date +%s)
  PYTHONPATH="$PWD/src" "$python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -1 | tr -d '=')
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  if [ "$rc" -eq 0 ]; then status=PASS; else status=FAIL; failed=$((failed + 1)); fi
  echo "round $round/$rounds: $status (rc $rc) ${summary:-no summary} in ${secs}s, load $load"
  if [ "$rc" -ne 0 ]; then grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'; fi
done
echo "soak: $((rounds - failed)) of $rounds rounds passed"
[ "$failed" -eq 0 ]
