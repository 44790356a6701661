# Every target installs what it needs first (scripts/setup.sh is idempotent).
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8080
CONFIG ?=

.PHONY: setup serve test lint typecheck unit bench bench-gateway bench-engine clean

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

bench: bench-gateway bench-engine

bench-gateway: setup
	@scripts/setup-litellm.sh
	$(BIN)/python bench/gateway_bench.py

bench-engine: setup
	$(BIN)/python bench/engine_bench.py

clean:
	rm -rf $(VENV) .venv-litellm .ncap .pytest_cache .mypy_cache .ruff_cache
