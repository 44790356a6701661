"""``ncap serve --workers N``: a small supervisor of N gateway processes on one port.

Each worker is an ordinary ``ncap serve`` bound with ``SO_REUSEPORT``, so the kernel
spreads connections over them; each has its own instance id and heartbeat, and all of
them use the configured shared stores. The supervisor forwards SIGTERM/SIGINT (each
worker drains its in-flight requests) and restarts a worker that dies unexpectedly —
its in-flight rows are then recovered by its peers as ``gateway_lost``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import FrameType

from rich.console import Console

from ncap.config import Config
from ncap.stores import shared_between_processes

__all__ = ["refuse_unshared", "supervise"]

RESTART_DELAY_S = 1.0
err = Console(stderr=True)


def refuse_unshared(cfg: Config, workers: int) -> str | None:
    """Why ``workers`` processes cannot share ``cfg``'s stores (None: they can)."""
    if workers <= 1:
        return None
    for name, url in (("budgets", cfg.stores.budgets), ("ledger", cfg.stores.ledger)):
        if not shared_between_processes(url):
            return (
                f"--workers {workers} needs stores every worker shares, but stores.{name} is "
                f"{url} (in-process: each worker would enforce its own budget). Use "
                "redis://… budgets and a postgresql://… or sqlite:///… ledger."
            )
    return None


def supervise(worker_args: list[str], workers: int) -> int:
    """Run ``workers`` copies of ``ncap serve <worker_args>`` until signalled."""
    command = [sys.executable, "-m", "ncap.cli.main", "serve", *worker_args, "--reuse-port"]
    procs = [subprocess.Popen(command) for _ in range(workers)]
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        time.sleep(0.2)
        for i, proc in enumerate(procs):
            if proc.poll() is not None and not stopping:
                err.print(f"worker {proc.pid} exited ({proc.returncode}); restarting it")
                time.sleep(RESTART_DELAY_S)
                procs[i] = subprocess.Popen(command)
    return max((proc.wait() for proc in procs), default=0)
