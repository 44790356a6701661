"""The access-log line's totals, worked out in one pass over the attempts, equal the
plain formulation (a comprehension and a sum per total) for any mix of attempts:
denied, answered, failed, cut, with counts known or not; and its JSON is the plain
dict's encoded with sorted keys, byte for byte."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import msgspec

from ncap.http.signals import AccessLine, _Closed, _line, _Record

OUTCOMES = ["completed", "stream_cut", "timeout", "rejected", "upstream_error", "denied"]
STATES = ["settled", "pending", "usage_reconciliation_required", "denied", None]


def expected(record: _Record) -> dict[str, Any]:
    """The line as a comprehension and a sum per total would give it."""

    def total(values: Any) -> int | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    plan, caller = record.plan, record.caller
    attempts = [view(a) for a in record.attempts if a.number > 0]
    line: dict[str, Any] = {
        "event": "request",
        "request_id": record.request_id,
        "workload": caller.workload_id if caller else None,
        "environment": caller.environment if caller else None,
        "status": record.status,
        "error_code": record.error_code,
        "latency_ms": record.latency_ms,
        "attempts": len(attempts),
    }
    if plan is not None:
        denied = any(a.number == 0 for a in record.attempts)
        answered = [a for a in attempts if a["outcome"] in ("completed", "stream_cut")]
        line.update(
            model=plan.alias,
            route=attempts[-1]["route"] if attempts else plan.usable_routes[0].id,
            stream=plan.stream,
            emulated=plan.emulated,
            policy_result="deny" if denied else "allow",
            policy_reason=record.error_code if denied else plan.decision.policy_reason,
            exception_id=plan.decision.exception_id,
            candidates_requested=plan.decision.requested,
            candidates_effective=plan.decision.effective,
            candidates_returned=total(a["returned"] for a in answered),
            reserved_tokens=plan.reservation.total_tokens,
            input_tokens=total(a["input_tokens"] for a in attempts),
            output_tokens=total(a["output_tokens"] for a in attempts),
            cost_micros=total(a["cost_micros"] for a in attempts),
            states=sorted({str(a["state"]) for a in attempts}),
        )
    return line


def view(closed: _Closed) -> dict[str, Any]:
    final = closed.final
    return {
        "route": closed.route,
        "outcome": closed.outcome,
        "state": final["state"],
        "returned": final["returned_candidate_count"],
        "input_tokens": final["input_tokens"],
        "output_tokens": final["output_tokens_total"],
        "cost_micros": final["cost_micros"],
    }


def record(rng: random.Random) -> _Record:
    rec = _Record(f"req-{rng.randrange(1000)}", 1.0, 2)
    if rng.random() < 0.9:
        rec.caller = SimpleNamespace(workload_id="w", environment=rng.choice(["prod", "eval"]))
    if rng.random() < 0.85:
        decision = SimpleNamespace(
            policy_reason="within_default", exception_id=rng.choice([None, "q4"]),
            requested=rng.choice([None, 1, 4]), effective=rng.choice([1, 4]),
        )  # fmt: skip
        rec.plan = SimpleNamespace(
            alias="m", usable_routes=[SimpleNamespace(id="primary")], stream=rng.random() < 0.5,
            emulated=rng.random() < 0.3, decision=decision,
            reservation=SimpleNamespace(total_tokens=rng.randrange(10, 5000)),
        )  # fmt: skip
    count = rng.choice([0, 0, 1, 1, 1, 2, 3])
    numbers = ([0] if rng.random() < 0.15 else []) + list(range(1, count + 1))
    for number in numbers:
        maybe = lambda: rng.choice([None, 0, 1, 7, 1234])  # noqa: E731
        final = {
            "state": rng.choice(STATES),
            "returned_candidate_count": maybe(),
            "input_tokens": maybe(),
            "output_tokens_total": maybe(),
            "cost_micros": maybe(),
        }
        route = rng.choice(["primary", "fallback"]) if number else None
        rec.attempts.append(_Closed(number, route, rng.choice(OUTCOMES), final))
    rec.status, rec.error_code = rng.choice([(200, None), (429, "budget_exhausted"), (502, "x")])
    rec.latency_ms = round(rng.uniform(0, 900), 3)
    return rec


def test_the_line_equals_the_plain_formulation_and_encodes_as_its_sorted_dict() -> None:
    rng = random.Random(11)
    kinds = set()
    sorted_json = msgspec.json.Encoder(order="sorted").encode
    for _ in range(3000):
        rec = record(rng)
        line = _line(rec)
        plain = expected(rec)
        assert line.fields() == plain
        assert msgspec.json.encode(line) == sorted_json(plain)
        fields = line.fields()
        kinds.add((rec.plan is None, fields["attempts"], fields.get("policy_result")))
    assert (False, 0, "deny") in kinds and (False, 3, "allow") in kinds and (True, 0, None) in kinds


def test_the_line_declares_its_fields_in_key_order() -> None:
    """What lets it skip sorting its keys per line."""
    assert list(AccessLine.__struct_fields__) == sorted(AccessLine.__struct_fields__)
