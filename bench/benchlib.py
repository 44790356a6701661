"""Process plumbing shared by the benchmark scripts (no load generation here).

Servers under test run as child processes in their own process group so that a
whole tree (uvicorn or granian workers, LiteLLM's helpers) can be measured and
stopped together. Memory and CPU are read from /proc for the full tree, because
a server's parent may only supervise while a child does the work.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
VENV_PY = ROOT / ".venv" / "bin" / "python"
RESULTS = BENCH / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")

CHAT_BODY: dict[str, object] = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hello in five words."},
    ],
    "n": 1,
    "max_tokens": 16,
    "temperature": 0.7,
}


def chat_body(model: str, stream: bool = False) -> bytes:
    """The fixed small request every target gets, so only the target differs."""
    body = dict(CHAT_BODY, model=model)
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def free_port() -> int:
    """An unused loopback port (the kernel picks; racy but fine on one machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pin_prefix(cpus: str | None) -> list[str]:
    """``taskset -c CPUS`` when asked for and available, else nothing."""
    if not cpus or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", cpus]


@dataclass
class Server:
    """A started server process (group leader) and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def start_server(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Server:
    """Start ``argv`` in a new session with stdout/stderr to ``log_dir/name.log``."""
    log = log_dir / f"{name}.log"
    full_env = dict(os.environ, **(env or {}))
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            cwd=cwd,
        )
    return Server(name, proc, log)


def stop_server(server: Server, grace_s: float = 5.0) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    if server.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.proc.wait(grace_s)


def wait_ready(server: Server, url: str, body: bytes, timeout_s: float = 60.0) -> None:
    """Poll ``url`` with a real request until it answers 200, or fail loudly."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited ({server.proc.returncode}):\n{server.tail()}")
        status, last = _post(url, body)
        if status == 200:
            return
        time.sleep(0.25)
    raise RuntimeError(f"{server.name} not ready after {timeout_s:.0f}s: {last}\n{server.tail()}")


def _post(url: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status), "ok"
    except urllib.error.HTTPError as exc:
        return exc.code, f"HTTP {exc.code}: {exc.read()[:300]!r}"
    except (OSError, TimeoutError) as exc:
        return 0, repr(exc)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    kids = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def rss_mib(pid: int) -> float:
    """Resident memory of the process tree rooted at ``pid`` (VmRSS summed), MiB."""
    total_kib = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
    return round(total_kib / 1024, 1)


def cpu_seconds(pid: int) -> float:
    """User+system CPU time consumed so far by the tree rooted at ``pid``."""
    ticks = 0
    for p in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLK_TCK


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def machine_info() -> dict[str, object]:
    """What a reader needs to judge the numbers: cores, load, Python, kernel."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_at_start": loadavg(),
        "python": sys.version.split()[0],
        "kernel": os.uname().release,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def run_loadgen(
    url: str,
    body_model: str,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    stream: bool = False,
    cpus: str | None = None,
    requests: int | None = None,
) -> dict[str, object]:
    """Run bench/loadgen.py in its own process (own core, own GIL) and parse its JSON."""
    argv = [
        *pin_prefix(cpus),
        str(VENV_PY),
        str(BENCH / "loadgen.py"),
        url,
        "--model",
        body_model,
        "-c",
        str(concurrency),
        "--duration",
        str(duration_s),
        "--warmup",
        str(warmup_s),
        "--json",
    ]
    if stream:
        argv.append("--stream")
    if requests:
        argv += ["--requests", str(requests)]
    out = subprocess.run(argv, capture_output=True, check=True, timeout=duration_s + 300)
    result: dict[str, object] = json.loads(out.stdout)
    return result


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent not idle (all cores, since boot)."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / CLK_TCK


def _children_cpu_s() -> float:
    """CPU of this process's finished children (the load generator runs)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@contextlib.contextmanager
def measured(pid: int, others: Sequence[int] = ()) -> Iterator[dict[str, float]]:
    """CPU of the ``pid`` tree, wall time, and the share of the machine that went to
    *foreign* processes (not ``pid``, ``others`` or the load generator) meanwhile:
    the noise indicator for a shared machine."""
    pids = list(dict.fromkeys([pid, *others]))
    stats: dict[str, float] = {}
    cpu0 = {p: cpu_seconds(p) for p in pids}
    busy0, kids0, t0 = machine_busy_s(), _children_cpu_s(), time.monotonic()
    yield stats
    wall = time.monotonic() - t0
    used = {p: cpu_seconds(p) - cpu0[p] for p in pids}
    ours = sum(used.values()) + _children_cpu_s() - kids0
    foreign = max(0.0, machine_busy_s() - busy0 - ours)
    stats.update(
        cpu_s=used[pid], wall_s=wall, foreign_share=foreign / (wall * (os.cpu_count() or 1))
    )


def upstream_argv(port: int, module: str | None = None) -> list[str]:
    """The fake upstream: ncap's own when importable, else the bench stand-in."""
    mod = module or fake_upstream_module()
    if mod == "ncap.testing.fake_upstream":
        return [str(VENV_PY), "-m", mod, "--port", str(port)]
    return [str(VENV_PY), str(BENCH / "standin_upstream.py"), "--port", str(port)]


def fake_upstream_module() -> str:
    """Which fake upstream exists; the stand-in is for harness development only."""
    probe = subprocess.run(
        [str(VENV_PY), "-c", "import ncap.testing.fake_upstream"], capture_output=True
    )
    if probe.returncode == 0:
        return "ncap.testing.fake_upstream"
    print(
        "WARNING: ncap.testing.fake_upstream not importable; using bench/standin_upstream.py",
        file=sys.stderr,
    )
    return "standin"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --- the result envelope: what every benchmark behind ``make bench`` leaves behind ---
#
# ``bench/results/<name>.json`` holds the last run of one benchmark: the machine, the
# date, the commit, the load average at start and end, the command line and each table
# ready to render (``bench/render_benchmarks.py`` turns the envelopes into BENCHMARKS.md).
# The run it replaces moves to ``bench/results/history/<name>-<its date>.json``.

ENVELOPE_VERSION = 1
# when this module was imported: the start of the benchmark script that imported it
_STARTED = dt.datetime.now(dt.UTC)
_LOAD_AT_START = [float(x) for x in os.getloadavg()]


@dataclass
class Table:
    """One table of a benchmark's result, ready to render.

    ``command`` is the command line that produced it when it differs from the run's
    (a script that runs several measurements); empty means the run's command.
    """

    title: str
    columns: list[str]
    rows: list[list[Any]]
    command: str = field(default="", kw_only=True)
    notes: str = field(default="", kw_only=True)


def _read_first(path: str, prefix: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip() if ":" in line else line
    return ""


def machine() -> dict[str, Any]:
    """The machine a run was made on: CPU model, cores, memory, Python, OS."""
    mem_kib = _read_first("/proc/meminfo", "MemTotal").split()
    os_name = _read_first("/etc/os-release", "PRETTY_NAME=").split("=", 1)[-1].strip('"')
    return {
        "cpu": _read_first("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem_kib[0]) / 2**20, 1) if mem_kib else None,
        "python": platform.python_version(),
        "os": f"{os_name or platform.system()}, kernel {platform.release()}",
    }


_NOT_CODE = (":!bench/results", ":!BENCHMARKS.md")


def git_commit() -> str:
    """The short commit of the checkout, ``+dirty`` when its code differs from it (the
    results and the page, which a run of ``make bench`` rewrites as it goes, do not count)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *_NOT_CODE)
    return commit + ("+dirty" if changed else "")


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this script, paths shown relative to the repository."""
    args = list(sys.argv if argv is None else argv)
    with contextlib.suppress(ValueError):
        args[0] = str(Path(args[0]).resolve().relative_to(ROOT))
    return shlex.join(["python", *args])


def utc_stamp(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def envelope(
    name: str,
    tables: Sequence[Table],
    *,
    raw: Any = None,
    started: dt.datetime | None = None,
    load_start: Sequence[float] | None = None,
    load_end: Sequence[float] | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """The result envelope of one run (see the module's note above ``Table``)."""
    return {
        "envelope": ENVELOPE_VERSION,
        "benchmark": name,
        "date": utc_stamp(started or _STARTED),
        "finished": utc_stamp(dt.datetime.now(dt.UTC)),
        "commit": git_commit(),
        "command": command or command_line(),
        "machine": machine(),
        "load": {
            "start": [round(x, 2) for x in (load_start or _LOAD_AT_START)],
            "end": [round(x, 2) for x in (load_end or os.getloadavg())],
        },
        "tables": [asdict(t) for t in tables],
        "raw": raw,
    }


def rotate(path: Path) -> Path | None:
    """Move the run in ``path`` to ``history/<name>-<its date>.json``; where it went."""
    if not path.exists():
        return None
    try:
        date = str(json.loads(path.read_text()).get("date", ""))
    except (ValueError, AttributeError):
        date = ""
    if not date:
        date = utc_stamp(dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC))
    history = path.parent / "history"
    history.mkdir(parents=True, exist_ok=True)
    stamp = date.replace("-", "").replace(":", "")
    target = history / f"{path.stem}-{stamp}.json"
    suffix = 1
    while target.exists():
        suffix += 1
        target = history / f"{path.stem}-{stamp}-{suffix}.json"
    path.rename(target)
    return target


def save_result(
    name: str,
    tables: Sequence[Table],
    *,
    raw: Any = None,
    started: dt.datetime | None = None,
    load_start: Sequence[float] | None = None,
    load_end: Sequence[float] | None = None,
    command: str | None = None,
    results_dir: Path | None = None,
) -> Path:
    """Write this run's envelope to ``<results_dir>/<name>.json``, the previous run
    moved to the history first. ``started`` and ``load_start`` default to when the
    script imported this module; ``load_end`` to now."""
    out = (results_dir or RESULTS) / f"{name}.json"
    doc = envelope(
        name,
        tables,
        raw=raw,
        started=started,
        load_start=load_start,
        load_end=load_end,
        command=command,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    rotate(out)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(out)
    print(f"result: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}", file=sys.stderr)
    return out


def profile_table(profile: Path, title: str, count: int = 25, sort: str = "tottime") -> Table:
    """The top ``count`` functions of a cProfile dump as a table (by own or cumulative
    time), so a profile renders on the benchmarks page like any other result."""
    import pstats

    stats = pstats.Stats(str(profile)).strip_dirs()
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    raw = stats.stats  # type: ignore[attr-defined]
    index = 2 if sort == "tottime" else 3
    top = sorted(raw.items(), key=lambda kv: kv[1][index], reverse=True)[:count]
    total = sum(v[2] for v in raw.values()) or 1.0
    rows = [
        [f"{func} ({file}:{line})", calls, round(own, 3), round(cum, 3), f"{own / total:.1%}"]
        for (file, line, func), (_, calls, own, cum, _) in top
    ]
    columns = ["function", "calls", "own s", "cumulative s", "share of own time"]
    return Table(title, columns, rows)


def flat_rows(result: dict[str, Any], prefix: str = "") -> list[list[Any]]:
    """``[key, value]`` rows of a nested result, nested keys joined with dots."""
    rows: list[list[Any]] = []
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows += flat_rows(value, f"{name}.")
        elif isinstance(value, list | tuple | dict):
            rows.append([name, json.dumps(value)])
        else:
            rows.append([name, value])
    return rows


def flat_table(title: str, result: dict[str, Any], notes: str = "") -> Table:
    """A result that is one set of measures (not one row per target) as a table."""
    return Table(title, ["measure", "value"], flat_rows(result), notes=notes)
