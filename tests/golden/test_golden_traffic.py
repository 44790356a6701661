"""The gateway's whole behaviour on a fixed script of requests (``traffic.py``): every
status, header and body byte, every ledger row, the budget counters and holds, the
access-log lines and ``/metrics`` must equal ``traffic.json``, recorded before any
later change of the request path, on each store variant. A difference is shown as the
places that differ (steps by name), then a unified diff of the two recordings.
Re-record (only when a change of output is intended) with
``python -m tests.golden.record``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.golden.traffic import (
    VARIANTS,
    delta,
    diff,
    load_golden,
    record_variant,
    route_keys,
)

MAX_DIFF_LINES = 400


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return load_golden()


def _where(path: list[Any], recording: dict[str, Any]) -> str:
    """``steps[5].ledger[0].cost_micros`` as ``steps[chat_n3_native].ledger[0].cost_micros``."""
    out = ""
    for i, key in enumerate(path):
        if i == 1 and path[0] == "steps" and isinstance(key, int):
            out += f"[{recording['steps'][key]['step']}]"
        elif isinstance(key, int):
            out += f"[{key}]"
        else:
            out += f".{key}" if out else str(key)
    return out


def report(expected: dict[str, Any], recorded: dict[str, Any]) -> str:
    places = [_where(path, expected) for path, _ in delta(expected, recorded)]
    lines = diff(expected, recorded).splitlines()
    shown = "\n".join(lines[:MAX_DIFF_LINES])
    if len(lines) > MAX_DIFF_LINES:
        shown += f"\n... {len(lines) - MAX_DIFF_LINES} more lines"
    return "differs at:\n  " + "\n  ".join(places[:50]) + "\n" + shown


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_traffic_equals_the_golden(variant: str, golden: dict[str, Any], tmp_path: Path) -> None:
    with route_keys():
        recorded = record_variant(variant, tmp_path)
    expected = golden[variant]
    if recorded != expected:
        pytest.fail(
            f"the {variant} stores' traffic differs from the golden; " + report(expected, recorded),
            pytrace=False,
        )


def test_the_script_reaches_every_shape(golden: dict[str, Any]) -> None:
    """The golden holds what the script is for: answers, refusals of each kind, retries
    and fallbacks, replays, a client that left (not a run that failed early)."""
    steps = {s["step"]: s for s in golden["default"]["steps"]}
    statuses = {name: s["status"] for name, s in steps.items()}
    assert statuses["chat_n3_native"] == statuses["stream_n3_emulated_usage"] == 200
    assert statuses["deny_n_above_cap"] == statuses["bad_json"] == 400
    assert statuses["tight_first"] == 200 and statuses["tight_exhausted"] == 429
    assert statuses["no_api_key"] == statuses["bad_api_key"] == 401
    assert statuses["unknown_model"] == 404 and statuses["upstream_timeout"] == 504
    assert statuses["upstream_500_seen"] == 502 and statuses["idempotent_stream_repeat"] == 409
    attempts = [r["route_id"] for r in steps["upstream_500_fallback"]["ledger"]]
    assert attempts == ["broken", "broken", "fake"]
    assert [r["upstream_status"] for r in steps["upstream_429_then_ok"]["ledger"]] == [429, None]
    replay = dict(h.split(": ", 1) for h in steps["idempotent_replay"]["headers"])
    assert replay["x-ncap-idempotent-replay"] == "<req:idempotent_first>"
    (cut,) = steps["stream_client_disconnect"]["ledger"]
    assert (cut["state"], cut["reconciliation_reason"]) == ("pending", "stream_cut")
