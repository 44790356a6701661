"""A FinOps walk-through: generate a ledger, audit it, open the dashboard.

    python examples/finops_walkthrough.py [--rows 20000] [--dir ./finops-demo]

1. ``ncap ledger generate`` writes a realistic synthetic ledger (two weeks of several
   workloads, exceptions, denials, retries, pending rows, and a client that starts
   sending ``n=2`` two days ago) and a matching config.
2. ``ncap audit --since 7d`` reads it: requested-candidate distribution, mismatches,
   output per request, exception usage, denials, pending reconciliation, spend, and
   the distribution-shift alert the ``n=2`` client raises.
3. ``ncap serve`` on that config, with an admin key; the dashboard at ``/dashboard``
   shows the same report as charts (the script fetches it with the admin key and
   prints the URL; open it in a browser and sign in with the key it prints).

Every step is the CLI an operator types; the script only runs them in order.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def ncap(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One ``ncap`` command (the console script beside this Python, else the module)."""
    script = Path(sys.executable).with_name("ncap")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ncap.cli.main"]
    print("$ ncap " + " ".join(args), flush=True)
    return subprocess.run(
        [*command, *args], check=True, capture_output=True, text=True, env=env, timeout=600
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the gateway at {url} did not become ready")


def dashboard(url: str, admin_key: str) -> tuple[str, dict[str, object]]:
    headers = {"Authorization": f"Bearer {admin_key}"}
    page = urllib.request.Request(url + "/dashboard?since=7d", headers=headers)
    with urllib.request.urlopen(page, timeout=30) as reply:
        html = reply.read().decode()
    data = urllib.request.Request(url + "/dashboard/report.json?since=7d", headers=headers)
    with urllib.request.urlopen(data, timeout=30) as reply:
        report = json.loads(reply.read())
    return html, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dir", type=Path, default=Path("finops-demo"))
    parser.add_argument("--keep-serving", action="store_true", help="leave the gateway up")
    args = parser.parse_args(argv)
    work: Path = args.dir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ledger, config = work / "ledger.db", work / "ncap.yaml"

    # 1. a synthetic ledger and its config
    made = ncap("ledger", "generate", "--rows", str(args.rows), "--out", str(ledger),
                "--write-config", str(config))  # fmt: skip
    print(made.stderr.strip())

    # 2. the audit, as tables and as JSON
    print(ncap("audit", "--since", "7d", "--config", str(config)).stdout)
    audit = json.loads(ncap("audit", "--since", "7d", "--format", "json",
                            "--config", str(config)).stdout)  # fmt: skip
    shift = [a for a in audit["alerts"] if a["source"] == "distribution_shift"]
    print(f"{audit['totals']['requests']:,} requests in the window; "
          f"{len(shift)} distribution-shift alert(s)")  # fmt: skip

    # 3. the dashboard
    admin_key = "ncap-admin-" + secrets.token_urlsafe(16)
    port = free_port()
    env = {**os.environ, "NCAP_ADMIN_KEY": admin_key}
    script = Path(sys.executable).with_name("ncap")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ncap.cli.main"]
    serve = [*command, "serve", "--config", str(config), "--port", str(port)]
    print("$ NCAP_ADMIN_KEY=… ncap " + " ".join(serve[len(command) :]), flush=True)
    server = subprocess.Popen(serve, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        html, report = dashboard(url, admin_key)
        bars = html.count("data-value=")
        print(f"dashboard: {len(html):,} bytes of HTML, {bars} chart bars, "
              f"{len(report['alerts'])} alert(s)")  # fmt: skip
        print(f"open {url}/dashboard and sign in with the admin key {admin_key}")
        if args.keep_serving:
            print("serving; Ctrl-C to stop")
            server.wait()
    finally:
        server.terminate()
        server.wait(10)
    return 0 if shift and bars else 1


if __name__ == "__main__":
    sys.exit(main())
