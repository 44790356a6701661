"""Reports on a large ledger: ``ncap audit --since 7d`` and ``/dashboard`` load time.

Generates a synthetic ledger (``ncap ledger generate``) unless one is given, times the
audit as a user runs it (a fresh ``ncap`` process, JSON to /dev/null, so startup is
included), then serves the ledger with the gateway and times the dashboard's first
load in headless Chromium (Bearer admin key; navigation start to the load event).
Measure once on a quiet machine; CI runs none of this.

    .venv/bin/python bench/report_bench.py --rows 1000000 [--ledger FILE --config FILE]
    .venv/bin/python bench/report_bench.py --rows 20000          # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from ncap.config import parse_config  # noqa: E402
from ncap.http.app import create_app  # noqa: E402
from ncap.testing.ledger_gen import LedgerSpec, generate_ledger, synthetic_config  # noqa: E402
from tests.support import ServerThread  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def ensure_ledger(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path]:
    if args.ledger and args.config:
        return Path(args.ledger), Path(args.config)
    ledger, config = tmp / "ledger.db", tmp / "ncap.yaml"
    spec = LedgerSpec(rows=args.rows)
    started = time.perf_counter()
    generate_ledger(ledger, spec)
    print(f"generate {args.rows:,} rows: {time.perf_counter() - started:.1f} s")
    raw = synthetic_config(spec, ledger)
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return ledger, config


def time_audit(config: Path, since: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "ncap.cli.main",
        "audit",
        "--since",
        since,
        "--format",
        "json",
        "-c",
        str(config),
    ]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - started


def time_dashboard(config_path: Path, since: str) -> tuple[float, float]:
    from playwright.sync_api import sync_playwright

    raw = yaml.safe_load(config_path.read_text())
    raw["routes"].pop("local-smollm2", None)  # nothing to load: the dashboard only reads
    raw["models"].pop("smollm2", None)
    raw["server"] = {"admin_key_env": "NCAP_BENCH_ADMIN_KEY"}
    os.environ["NCAP_BENCH_ADMIN_KEY"] = key = "bench-admin-key"
    config = parse_config(yaml.safe_dump(raw))
    server = ServerThread(lambda: create_app(config, instance_id="bench")).start()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            ctx = browser.new_context(extra_http_headers={"Authorization": f"Bearer {key}"})
            page = ctx.new_page()
            started = time.perf_counter()
            page.goto(f"{server.url}/dashboard?since={since}", wait_until="load")
            wall = time.perf_counter() - started
            timing = json.loads(page.evaluate("JSON.stringify(performance.timing)"))
            browser.close()
    finally:
        server.stop()
    return wall, (timing["loadEventEnd"] - timing["navigationStart"]) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ledger")
    parser.add_argument("--config")
    parser.add_argument("--since", default="7d")
    parser.add_argument("--dashboard-since", default="24h")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, config = ensure_ledger(args, Path(tmp))
        print(f"ncap audit --since {args.since}: {time_audit(config, args.since):.2f} s")
        for since in dict.fromkeys([args.dashboard_since, "7d"]):
            wall, load = time_dashboard(config, since)
            print(f"/dashboard?since={since} first load: {wall:.2f} s (load event {load:.2f} s)")


if __name__ == "__main__":
    main()
