# Every target installs what it needs first (scripts/setup.sh is idempotent).
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8080
CONFIG ?=

.PHONY: setup serve test lint typecheck unit mutation bench bench-instructions bench-front-instructions bench-request-levers bench-gateway bench-stream bench-stream-profile bench-ledger bench-rss bench-profile bench-stack bench-engine bench-engine-tools bench-engine-timeouts bench-export bench-telemetry bench-evidence bench-stream-instructions bench-report fuzz soak audit clean

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

# the installed packages against the PyPA/OSV advisory databases (needs the network,
# so it is not part of `make test`; see docs/reliability.md, "Dependency audit")
audit: setup
	$(BIN)/pip-audit --progress-spinner off --skip-editable

# mutation testing of the accounting core ([tool.mutmut] in pyproject.toml); not part of
# `make test`. Low parallelism by default: it is CPU-heavy. Results: docs/mutation.md.
MUTATION_JOBS ?= 2
# a subset, e.g. MUTANTS='ncap.lifecycle.settle.* ncap.stores._common.*' (all by default)
MUTANTS ?=
mutation: setup
	rm -rf mutants
	env -u PYTHONPATH $(BIN)/mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	env -u PYTHONPATH $(BIN)/python scripts/mutation_report.py --check

# every benchmark, then BENCHMARKS.md rendered from their results (bench/results/*.json);
# a benchmark that fails does not stop the others or the page, but fails the target
BENCHES = bench-gateway bench-stream bench-stream-profile bench-stream-instructions bench-instructions bench-request-levers bench-ledger bench-rss bench-profile bench-stack bench-engine bench-engine-tools bench-engine-timeouts bench-export bench-telemetry bench-evidence fuzz
bench:
	@$(MAKE) -k $(BENCHES); status=$$?; $(MAKE) bench-report && exit $$status

# BENCHMARKS.md from the results already in bench/results/ (runs nothing)
bench-report:
	$(BIN)/python bench/render_benchmarks.py

# every target (bare upstream, ncap's configurations, LiteLLM, Portkey) at every
# concurrency, side by side in one run, with the machine's load
bench-gateway: setup
	@scripts/setup-litellm.sh
	@scripts/setup-portkey.sh
	$(BIN)/python bench/gateway_bench.py --targets direct,bare,ncap-memory,ncap-ledger,ncap,ncap-sqlite,portkey,litellm --rounds 3 --warmup 3

# streamed answers: CPU per relayed chunk and time to first byte, n=1x500 and n=4x250,
# bare pass-through, ncap (memory, shipped default, fan-out), LiteLLM and Portkey in one run
STREAM_ROUNDS ?= 2
bench-stream: setup
	@scripts/setup-litellm.sh || echo "litellm: setup failed; reported as not installed"
	@scripts/setup-portkey.sh || echo "portkey: setup failed; reported as not installed"
	$(BIN)/python bench/stream_bench.py --rounds $(STREAM_ROUNDS)

# the relay's CPU per chunk by cause (one concern switched off at a time) and a cProfile top
bench-stream-profile: setup
	$(BIN)/python bench/stream_profile.py --rounds 2 --cprofile

# user-space instructions per relayed chunk under callgrind, by cause
bench-stream-instructions: setup
	$(BIN)/python bench/stream_instructions.py

# user-space instructions per request under callgrind: steady on a busy machine
bench-instructions: setup
	$(BIN)/python bench/instructions.py --setups bare,bare-lean,ncap-memory,ncap,ncap-shared --requests 2000

# the HTTP front's own instructions per request, one concern switched off at a time
bench-front-instructions: setup
	$(BIN)/python bench/front_instructions.py

# the same, with one concern of the request path switched off at a time (by cause)
bench-request-levers: setup
	$(BIN)/python bench/request_levers.py --setup ncap-memory

# what OpenTelemetry costs per request: off (this checkout, and BEFORE_SRC's), OTLP on
BEFORE_SRC ?=
bench-telemetry: setup
	$(BIN)/python bench/telemetry_cost.py --mode callgrind --requests 2000 $(if $(BEFORE_SRC),--before-src $(BEFORE_SRC))

bench-ledger: setup
	$(BIN)/python bench/ledger_check.py --requests 5000 --concurrency 64

# RSS after 200,000 requests vs after 20,000, for every store set-up
bench-rss: setup
	$(BIN)/python bench/rss_check.py --small 20000 --large 200000

# cProfile of ncap serve under load (full stats in bench/results/partial/profile-*)
bench-profile: setup
	$(BIN)/python bench/profile_gateway.py --setups ncap,ncap-memory,ncap-sqlite --duration 10

bench-stack: setup
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/stack_choice.py --rounds 3 --duration 4

# CPU per streamed chunk with the candidate evidence on and off: the relay path alone,
# then two whole gateways in one run (the ratio of the medians)
bench-evidence: setup
	$(BIN)/python bench/evidence_bench.py --rounds 9
	$(BIN)/python bench/evidence_bench.py --e2e --rounds 6 --requests 150

bench-engine: setup
	$(BIN)/python bench/engine_bench.py --repeat 3

# forced and auto tool calls: 200 seeded n=5 requests, every choice checked (long)
bench-engine-tools: setup
	$(BIN)/python bench/engine_tools_bench.py --seeds 200 --concurrency 4 --shards 4

# two CPU burners: 20 n=4 requests through the embedded default, then a timeout
bench-engine-timeouts: setup
	$(BIN)/python bench/engine_timeouts_bench.py --requests 20 --burners 2

# a generated 1,000,000-row ledger: ncap ledger export --format csv (under 30 s) and jsonl,
# and ncap audit --since 7d, each timed as its own process (EXPORT_ARGS=--events also
# times the event-by-event export for the ratio: minutes)
EXPORT_ROWS ?= 1000000
EXPORT_ARGS ?=
bench-export: setup
	$(BIN)/python bench/export_bench.py --rows $(EXPORT_ROWS) $(EXPORT_ARGS)

# the long fuzz pass (x10 the CI case counts: about 100,000 cases)
FUZZ_SCALE ?= 10
fuzz: setup
	$(BIN)/python bench/fuzz_pass.py --scale $(FUZZ_SCALE)

# soak: load + faults + disconnects, then the books (bounded to 600 s)
SOAK_S ?= 120
SOAK_STORES ?= embedded
SOAK_ARGS ?= --gemini
soak: setup
	$(BIN)/python bench/soak.py --duration $(SOAK_S) --stores $(SOAK_STORES) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .venv-litellm bench/portkey/node_modules .ncap .pytest_cache .mypy_cache .ruff_cache
