from __future__ import annotations

import pytest

from ncap.config import default_config, parse_config
from ncap.errors import ConfigError


def test_empty_file_is_the_embedded_default() -> None:
    assert parse_config("") == default_config()
    assert parse_config("# nothing but a comment\n") == default_config()


def test_sections_without_routes_keep_the_embedded_model() -> None:
    config = parse_config("limits: {max_candidates_absolute: 8}\n")
    assert config.models == {"smollm2": ["local-smollm2"]}
    assert config.limits.max_candidates_absolute == 8


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("workloads: {eval: {}}\nmodels: {}\nroutes: {}\n", "workload 'default', which is missing"),
        (
            "routes: {g: {provider: gemini}}\nmodels: {m: [g]}\n",
            "upstream_model is required for provider gemini",
        ),
        (
            "workloads: {default: {models: [nope]}}\nmodels: {}\nroutes: {}\n",
            "unknown model alias 'nope'",
        ),
        ("models: {m: [missing]}\nroutes: {}\n", "unknown route 'missing'"),
    ],
)
def test_unusable_configs_are_refused(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_max_age_needs_a_unit() -> None:
    """Decision (docs/decisions/config-max-age-needs-unit.md): ``max_age: 30`` is refused, since an
    operator who writes 30 means days far more often than seconds."""
    text = """
models: {m: [r]}
routes:
  r: {provider: openai, base_url: 'http://x', contract: {candidates: native, max_age: 30}}
"""
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.problems == [
        "<config>: routes.r.contract.max_age (line 4): a bare number is ambiguous: "
        "write the unit, e.g. 30d, 30h or 30s"
    ]
    contract = parse_config(text.replace("max_age: 30", "max_age: 3600s")).routes["r"].contract
    assert contract.max_age_delta is not None
    assert contract.max_age_delta.total_seconds() == 3600


def test_local_route_weights() -> None:
    """A local route's ``weights`` (docs/configuration.md): auto by default, three
    others by name, anything else refused with its location; the engine gets it."""
    from ncap.providers.local import settings_from_route

    text = "models: {m: [r]}\nroutes:\n  r: {provider: local, weights: %s}\n"
    assert parse_config(text % "auto").routes["r"].weights == "auto"
    assert (
        parse_config("models: {m: [r]}\nroutes: {r: {provider: local}}\n").routes["r"].weights
        == "auto"
    )
    for value in ("original", "q8_0", "q4_0"):
        route = parse_config(text % value).routes["r"]
        assert settings_from_route(route).weights == value
    with pytest.raises(ConfigError) as info:
        parse_config(text % "q2_k")
    assert any("routes.r.weights (line 3)" in p for p in info.value.problems), info.value.problems


def test_observability_otlp() -> None:
    """``otlp: {}`` turns spans and GenAI metrics on (the rest from OTEL_*); off by
    default; a bad endpoint or sampling share is refused with its location."""
    assert not default_config().observability.telemetry
    assert parse_config("observability: {otlp: {}}").observability.telemetry
    assert parse_config("observability: {traces: true}").observability.telemetry
    otlp = parse_config(
        "observability: {otlp: {endpoint: 'https://c:4318', sampling: 0.25}}"
    ).observability.otlp
    assert otlp is not None and otlp.sampling == 0.25 and otlp.headers == {}
    for bad, where in (
        ("{endpoint: 'grpc://c:4317'}", "observability.otlp.endpoint"),
        ("{sampling: 2}", "observability.otlp.sampling"),
        ("{endpont: 'http://c'}", "observability.otlp.endpont"),
    ):
        with pytest.raises(ConfigError) as refused:
            parse_config(f"observability: {{otlp: {bad}}}")
        assert any(where in p for p in refused.value.problems), refused.value.problems


def test_pending_age_as_a_bare_number_gets_the_documented_message() -> None:
    text = "reports:\n  thresholds:\n    pending_age: 24\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.problems == [
        "<config>: reports.thresholds.pending_age (line 3): a bare number is ambiguous: "
        "write the unit, e.g. 24d, 24h or 24s"
    ]
    assert parse_config(text.replace("24", "24h")).reports.thresholds.pending_age == "24h"


def test_a_sections_problem_points_at_its_name() -> None:
    text = "models: {m: [r]}\nroutes:\n  r:\n    provider: openai\n    timeout_s: 5\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.problems == [
        "<config>: routes.r (line 3): base_url is required for provider openai"
    ]
