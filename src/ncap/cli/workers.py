"""``ncap serve --workers N``: a small supervisor of N gateway processes on one port.

Each worker is an ordinary ``ncap serve`` bound with ``SO_REUSEPORT``, so the kernel
spreads connections over them; each has its own instance id and heartbeat, and all of
them use the configured shared stores. With ``server.instance_id`` set, worker ``i``
is ``<instance_id>-w<i>`` (the same slot keeps its id across restarts, so a restarted
worker recovers its own earlier incarnation's rows at once); without it each worker
has its host-and-pid default.

The supervisor forwards SIGTERM/SIGINT (each worker drains its in-flight requests),
also while it waits to restart a worker (no worker is started once stopping, and any
started meanwhile is stopped too), and restarts a worker that dies unexpectedly — its
in-flight rows are then recovered by its siblings or its successor as
``gateway_lost``. A worker that exits within ``STARTUP_S`` of its start
``MAX_START_FAILURES`` times in a row (a configuration or store it cannot use) stops
the whole group with that worker's exit status: its own error is on standard error.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

from rich.console import Console

from ncap.config import Config
from ncap.stores import shared_between_processes

__all__ = ["Supervisor", "refuse_unshared", "supervise", "worker_instance_id"]

RESTART_DELAY_S = 1.0
STARTUP_S = 10.0  # a worker that dies sooner than this after its start failed to start
MAX_START_FAILURES = 3
STOP_WAIT_S = 60.0  # then a worker that did not drain is killed
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


def worker_instance_id(base: str, slot: int) -> str:
    """The instance id of worker ``slot`` (from 1) when ``server.instance_id`` is set."""
    return f"{base}-w{slot}"


class Supervisor:
    """N worker processes, restarted when they die, stopped together."""

    def __init__(
        self,
        command: Callable[[int], list[str]],
        workers: int,
        *,
        restart_delay_s: float = RESTART_DELAY_S,
        startup_s: float = STARTUP_S,
        max_start_failures: int = MAX_START_FAILURES,
    ) -> None:
        self._command = command
        self._workers = workers
        self._restart_delay_s = restart_delay_s
        self._startup_s = startup_s
        self._max_failures = max_start_failures
        self.procs: list[subprocess.Popen[bytes]] = []
        self._started: list[float] = []
        self._failures = [0] * workers
        self.stopping = False
        self.exit_code = 0
        self._signalled: set[int] = set()

    def _spawn(self, slot: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(self._command(slot + 1))
        if self.stopping:  # a signal arrived while it started: it stops with the rest
            self._signalled.add(proc.pid)
            proc.send_signal(signal.SIGTERM)
        return proc

    def stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """SIGTERM to every running worker, once each: a second one would cut a
        worker's graceful shutdown short (its settlements, its registry entry)."""
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None and proc.pid not in self._signalled:
                self._signalled.add(proc.pid)
                proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        self.procs = [self._spawn(i) for i in range(self._workers)]
        self._started = [time.monotonic()] * self._workers
        while not self.stopping:
            time.sleep(0.2)
            for slot, proc in enumerate(self.procs):
                if proc.poll() is not None and not self.stopping:
                    self._exited(slot, proc)
        return self._wait_all()

    def _exited(self, slot: int, proc: subprocess.Popen[bytes]) -> None:
        quick = time.monotonic() - self._started[slot] < self._startup_s
        self._failures[slot] = self._failures[slot] + 1 if quick else 0
        if self._failures[slot] >= self._max_failures:
            err.print(
                f"worker {slot + 1} failed at start-up {self._failures[slot]} times in a "
                f"row (exit status {proc.returncode}, its error above); stopping all workers"
            )
            self.exit_code = proc.returncode or 1
            self.stop()
            return
        err.print(f"worker {proc.pid} exited ({proc.returncode}); restarting it")
        if self._pause(self._restart_delay_s):
            self.procs[slot] = self._spawn(slot)
            self._started[slot] = time.monotonic()

    def _pause(self, seconds: float) -> bool:
        """Sleep in short steps; False as soon as the group is stopping."""
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        return not self.stopping

    def _wait_all(self) -> int:
        self.stop()  # again: a worker started while the signal was handled
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(STOP_WAIT_S))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        # a worker killed by a signal (negative status) was restarted or is being
        # stopped: the group's status is its workers' own exit statuses
        return self.exit_code or max((c for c in codes if c > 0), default=0)


def supervise(worker_args: list[str], workers: int, instance_id: str | None = None) -> int:
    """Run ``workers`` copies of ``ncap serve <worker_args>`` until signalled."""
    base = [sys.executable, "-m", "ncap.cli.main", "serve", *worker_args, "--reuse-port"]

    def command(slot: int) -> list[str]:
        if instance_id is None:
            return base
        return [*base, "--instance-id", worker_instance_id(instance_id, slot)]

    group = Supervisor(command, workers)
    signal.signal(signal.SIGTERM, group.stop)
    signal.signal(signal.SIGINT, group.stop)
    return group.run()
