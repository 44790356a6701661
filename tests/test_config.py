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
            "routes: {g: {provider: gemini, base_url: 'https://x'}}\nmodels: {m: [g]}\n",
            "gemini is not available",
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


def test_max_age_accepts_a_number_of_seconds() -> None:
    text = """
models: {m: [r]}
routes:
  r: {provider: openai, base_url: 'http://x', contract: {candidates: native, max_age: 3600}}
"""
    contract = parse_config(text).routes["r"].contract
    assert contract.max_age_delta is not None
    assert contract.max_age_delta.total_seconds() == 3600
