# Every target installs what it needs first (scripts/setup.sh is idempotent).
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8080
CONFIG ?=

.PHONY: setup serve test lint typecheck unit mutation bench bench-gateway bench-ledger bench-stack bench-engine clean

setup:
	@scripts/setup.sh

serve: setup
	$(BIN)/ncap serve $(if $(CONFIG),--config $(CONFIG)) --port $(PORT)

lint: setup
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts

typecheck: setup
	$(BIN)/mypy --strict src

unit: setup
	$(BIN)/pytest -q

test: lint typecheck unit

# mutation testing of the accounting core ([tool.mutmut] in pyproject.toml); not part of
# `make test`. Low parallelism by default: it is CPU-heavy. Results: docs/mutation.md.
MUTATION_JOBS ?= 2
mutation: setup
	rm -rf mutants
	env -u PYTHONPATH $(BIN)/mutmut run --max-children $(MUTATION_JOBS)
	env -u PYTHONPATH $(BIN)/python scripts/mutation_report.py --check

bench: bench-gateway bench-ledger bench-stack bench-engine

bench-gateway: setup
	@scripts/setup-litellm.sh
	$(BIN)/python bench/gateway_bench.py --targets direct,ncap-memory,ncap-ledger,ncap,litellm --rounds 3

bench-ledger: setup
	$(BIN)/python bench/ledger_check.py --requests 5000 --concurrency 64

bench-stack: setup
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/stack_choice.py --rounds 3 --duration 4

bench-engine: setup
	$(BIN)/python bench/engine_bench.py --repeat 2

clean:
	rm -rf $(VENV) .venv-litellm .ncap .pytest_cache .mypy_cache .ruff_cache
