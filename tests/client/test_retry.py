from __future__ import annotations

import openai

from ncap.client import (
    DEFAULT_BACKOFF_S,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    async_retrying_client,
    retrying_client,
)


def test_reference_defaults() -> None:
    assert (DEFAULT_MAX_RETRIES, DEFAULT_BACKOFF_S, DEFAULT_TIMEOUT_S) == (2, 0.5, 30.0)


def test_sync_client_defaults_and_overrides() -> None:
    client = retrying_client(api_key="k", base_url="http://127.0.0.1:8080/v1")
    assert isinstance(client, openai.OpenAI)
    assert (client.max_retries, client.timeout) == (2, 30.0)
    assert str(client.base_url) == "http://127.0.0.1:8080/v1/"
    tuned = retrying_client(api_key="k", max_retries=5, timeout=5.0)
    assert (tuned.max_retries, tuned.timeout) == (5, 5.0)


def test_async_client_defaults() -> None:
    client = async_retrying_client(api_key="k")
    assert isinstance(client, openai.AsyncOpenAI)
    assert (client.max_retries, client.timeout) == (2, 30.0)


def test_the_sdk_backoff_starts_at_the_reference_500_ms() -> None:
    """Pins the SDK behaviour the docstring relies on; a new SDK that changes it fails here."""
    from openai import _constants

    assert _constants.INITIAL_RETRY_DELAY == DEFAULT_BACKOFF_S
    assert _constants.DEFAULT_MAX_RETRIES == DEFAULT_MAX_RETRIES
