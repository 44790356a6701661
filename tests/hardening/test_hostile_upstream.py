"""Hostile upstreams against every outbound client of the gateway: the shared provider
transport (OpenAI and Gemini routes, whole and streamed), ``ncap probe`` and the budget
alert webhook. Each upstream is a real aiohttp server on a free port doing one bad
thing; the client is the official ``openai`` SDK.

Redirects: an upstream answering 3xx to another origin must get nothing re-sent there
(not the route's credential, not its headers, not the prompt); the attempt fails.
"""

from __future__ import annotations

import functools
import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from aiohttp import web
from typer.testing import CliRunner

from ncap.auth import hash_key
from ncap.cli.main import app as cli
from ncap.config import Config
from tests.hardening.hostile import Recorder, chat_chunk, chat_completion, gemini_answer, serve, sse
from tests.support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ServerThread, gateway, gateway_config

CLIENT_KEY = "sk-ncap-client-key-hostile-upstream"
ROUTE_SECRET = "route-header-secret-7Qm"
GEMINI_KEY_ENV = "NCAP_TEST_HOSTILE_GEMINI_KEY"
GEMINI_KEY = "AIza-hostile-gemini-key-9x"
PROMPT = "the-prompt-canary-J3k"
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
REDIRECTS = (301, 302, 303, 307, 308)


class Redirector:
    """Answers every request with ``status`` to the same path on ``target``."""

    def __init__(self) -> None:
        self.status = 307
        self.target = ""
        self.hits = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.hits += 1
        return web.Response(status=self.status, headers={"Location": self.target + request.path_qs})


@pytest.fixture(scope="module")
def recorder() -> Iterator[tuple[Recorder, ServerThread]]:
    rec = Recorder()
    with serve(rec.handle) as server:
        yield rec, server


@pytest.fixture(scope="module")
def redirector(recorder: tuple[Recorder, ServerThread]) -> Iterator[tuple[Redirector, str]]:
    red = Redirector()
    red.target = recorder[1].url  # another origin: another port
    with serve(red.handle) as server:
        yield red, server.url


def _config(
    base: str,
    tmp: Path,
    routes: dict[str, Any] | None = None,
    models: dict[str, Any] | None = None,
    **overrides: Any,
) -> Config:
    """An OpenAI route and a Gemini route, both at ``base``; a client key."""
    return gateway_config(
        base + "/v1",
        tmp,
        keys=[{"hash": hash_key(CLIENT_KEY), "workload": "default"}],
        routes={
            "fake": {"retries": 0, "headers": {"x-route-secret": ROUTE_SECRET}},
            "gem": {
                "provider": "gemini",
                "base_url": base + "/v1beta",
                "upstream_model": "gemini-2.5-flash",
                "api_key_env": GEMINI_KEY_ENV,
                "retries": 0,
                "headers": {"x-route-secret": ROUTE_SECRET},
                "pricing": {"input_per_mtok": 0.3, "output_per_mtok": 2.5},
            },
            **(routes or {}),
        },
        models={"fake-model": ["fake"], "gem-model": ["gem"], **(models or {})},
        **overrides,
    )


@pytest.fixture(scope="module")
def redirected_gw(
    redirector: tuple[Redirector, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    mp = pytest.MonkeyPatch()
    mp.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    mp.setenv(GEMINI_KEY_ENV, GEMINI_KEY)
    with gateway(_config(redirector[1], tmp_path_factory.mktemp("redirect"))) as server:
        yield server
    mp.undo()


def _client(gw: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=CLIENT_KEY, max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["fake-model", "gem-model"])
@pytest.mark.parametrize("status", REDIRECTS)
def test_a_redirect_is_a_failed_attempt_and_nothing_reaches_its_target(
    redirected_gw: ServerThread,
    redirector: tuple[Redirector, str],
    recorder: tuple[Recorder, ServerThread],
    status: int,
    model: str,
    stream: bool,
) -> None:
    red, rec = redirector[0], recorder[0]
    red.status, hits, rec.seen[:] = status, red.hits, []
    with pytest.raises(openai.APIStatusError) as failed:
        if stream:
            for _ in _client(redirected_gw).chat.completions.create(
                model=model, messages=MESSAGES, stream=True
            ):
                pass
        else:
            _client(redirected_gw).chat.completions.create(model=model, messages=MESSAGES)
    assert failed.value.status_code == 502
    assert "redirect" in failed.value.message
    assert red.hits == hits + 1  # one attempt, not retried on the same route
    assert rec.seen == []  # no credential, header or prompt re-sent to the other origin


def test_a_redirect_falls_back_to_the_next_route(
    redirector: tuple[Redirector, str],
    recorder: tuple[Recorder, ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A redirecting route is the route's fault, not the request's: the chain goes on."""
    red, rec = redirector[0], recorder[0]
    red.status, rec.seen[:] = 307, []
    with serve(Recorder().handle) as honest:
        config = _config(
            redirector[1],
            tmp_path,
            routes={"honest": {"provider": "openai", "base_url": honest.url + "/v1"}},
            models={"fake-model": ["fake", "honest"]},
        )
        with gateway(config) as gw:
            reply = _client(gw).chat.completions.create(model="fake-model", messages=MESSAGES)
    assert reply.choices[0].message.content == "ok"
    assert rec.seen == []


def test_probe_does_not_follow_a_redirect(
    redirector: tuple[Redirector, str],
    recorder: tuple[Recorder, ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    red, rec = redirector[0], recorder[0]
    red.status, rec.seen[:] = 307, []
    monkeypatch.setenv(GEMINI_KEY_ENV, GEMINI_KEY)
    path = tmp_path / "ncap.yaml"
    config = _config(redirector[1], tmp_path)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    for route in ("fake", "gem"):
        result = CliRunner().invoke(cli, ["probe", route, "--dry-run", "--config", str(path)])
        assert result.exit_code == 1, result.output  # inconclusive: nothing to record
    assert red.hits >= 2
    assert rec.seen == []


def test_the_alert_webhook_does_not_follow_a_redirect(
    redirector: tuple[Redirector, str], recorder: tuple[Recorder, ServerThread], tmp_path: Path
) -> None:
    red, rec = redirector[0], recorder[0]
    red.status, rec.seen[:] = 307, []
    hits = red.hits
    with serve(Recorder().handle) as honest:
        config = gateway_config(
            honest.url + "/v1",
            tmp_path,
            workloads={"default": {"max_candidates": 1, "output_ceiling": 20, "usd_per_day": 1}},
            routes={"fake": {"pricing": {"input_per_mtok": 0, "output_per_mtok": 20_000}}},
            alerts={"webhook_url": redirector[1] + "/hook", "thresholds": [1], "retries": 0},
        )
        with gateway(config) as gw:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
            deadline = time.monotonic() + 10
            while red.hits == hits and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # a followed redirect would have arrived by now
    assert red.hits == hits + 1
    assert rec.seen == []


# --- an upstream that echoes the route's credential back ---

SECRETS = (UPSTREAM_KEY, GEMINI_KEY, ROUTE_SECRET)


def _credentials(request: web.Request) -> str:
    names = ("Authorization", "x-goog-api-key", "x-route-secret")
    return " ".join(request.headers[h] for h in names if h in request.headers)


async def _echo(request: web.Request) -> web.StreamResponse:
    """A 400 whose message, code, param and request id all repeat what the gateway sent."""
    await request.read()
    creds = _credentials(request)
    rid = {"x-request-id": "req-" + creds.replace(" ", "-")}
    if "generatecontent" in request.path.lower():  # Gemini's generate and stream methods
        google = {
            "code": 400,
            "message": f"API key not valid: {creds}",
            "status": "INVALID_ARGUMENT",
        }
        return web.json_response({"error": google}, status=400, headers=rid)
    error = {
        "message": f"Incorrect API key provided: {creds}",
        "type": "invalid_request_error",
        "param": creds,
        "code": creds,
    }
    return web.json_response({"error": error}, status=400, headers=rid)


async def _odd_ids(request: web.Request) -> web.StreamResponse:
    """A 200 whose request id names the credential, or is 4000 characters long."""
    await request.read()
    if "long" in request.path:
        rid = "r" * 4000
    elif "odd" in request.path:
        rid = "req<script>\u00e9"
    else:
        rid = "req-" + _credentials(request).replace(" ", "-")
    return web.json_response(
        chat_completion(),
        headers={"x-request-id": rid},
    )


def _export(config: Config, tmp: Path) -> str:
    path = tmp / "ncap.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    out = CliRunner().invoke(cli, ["ledger", "export", "--since", "1d", "--config", str(path)])
    assert out.exit_code == 0, out.output
    return out.stdout


def _stored(tmp: Path) -> bytes:
    """Every byte of the SQLite ledger and budgets (databases, WAL and SHM)."""
    return b"".join(p.read_bytes() for p in tmp.glob("*.db*"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["fake-model", "gem-model"])
def test_an_echoed_credential_reaches_neither_client_nor_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, stream: bool
) -> None:
    monkeypatch.setenv(GEMINI_KEY_ENV, GEMINI_KEY)
    with serve(_echo) as echo:
        config = _config(echo.url, tmp_path)
        with gateway(config) as gw, pytest.raises(openai.BadRequestError) as failed:
            reply = _client(gw).chat.completions.create(
                model=model, messages=MESSAGES, stream=stream
            )
            for _ in reply if stream else ():
                pass
    text = failed.value.response.text
    assert "API key" in text  # the upstream's message is still relayed, scrubbed
    assert "[redacted]" in text
    exported = _export(config, tmp_path)
    rows = [json.loads(line) for line in exported.splitlines()]
    assert rows and all(r["provider_request_id"] is None for r in rows)
    for secret in SECRETS:
        assert secret not in text
        assert secret not in exported
        assert secret.encode() not in _stored(tmp_path)


@pytest.mark.parametrize("kind", ["credential", "long", "odd"])
def test_request_ids_are_bounded_in_length_and_alphabet(tmp_path: Path, kind: str) -> None:
    with serve(_odd_ids) as odd:
        config = _config(odd.url + "/" + kind, tmp_path)
        with gateway(config) as gw:
            reply = _client(gw).chat.completions.create(model="fake-model", messages=MESSAGES)
    assert reply.choices[0].message.content == "ok"
    rows = [json.loads(line) for line in _export(config, tmp_path).splitlines()]
    # the answer's own body id is the fallback; the header's id was not plausible
    assert [r["provider_request_id"] for r in rows] == ["chatcmpl-hostile"]
    assert UPSTREAM_KEY.encode() not in _stored(tmp_path)


# --- an upstream that floods: answers far larger than any request could ask for ---

MIB = 1 << 20
FLOOD_BYTES = 64 * MIB


def _in_flight_bound() -> int:
    """The most one loopback connection can hold between the flood's writes and the
    gateway's reads: the sender's and the receiver's socket buffers at their
    autotuning maxima (Linux: the third value of ``tcp_wmem`` and ``tcp_rmem``)."""
    total = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        except (OSError, ValueError, IndexError):
            total += 4 * MIB
    return total


def _stopped_reading(sent: int) -> bool:
    """What the flood sent stays within the bound plus what the socket buffers hold
    (and a margin for the last writes): the gateway hung up instead of reading on.
    The flood itself is larger, so a gateway that read it all would fail this."""
    limit = DEFAULT_BOUND + _in_flight_bound() + MIB
    assert limit < FLOOD_BYTES, "the flood must be larger than what can be in flight"
    return sent < limit


class Flood:
    """Answers 200 with ``size`` bytes (a JSON completion, an SSE stream, or a gzip bomb),
    chunked, and counts what it managed to send before the gateway hung up."""

    def __init__(self) -> None:
        self.sent = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read() or b"{}")
        kind = request.path.split("/")[1]
        size = FLOOD_BYTES
        if kind == "bomb":  # 64 MiB of JSON, about 64 KiB on the wire
            return web.Response(
                body=_bomb(size),
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        if kind == "declared":  # says its size up front
            return web.Response(body=b" " * (8 * MIB), content_type="application/json")
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream" if body.get("stream") else "application/json"
            }
        )
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        piece = (
            b"data: " + json.dumps(chat_chunk("x" * 4000)).encode() + b"\n\n"
            if body.get("stream")
            else b'{"id": "chatcmpl-flood", "choices": [], "padding": "' + b"x" * 65536
        )
        try:
            while self.sent < size:
                await resp.write(piece)
                self.sent += len(piece)
        except (ConnectionError, RuntimeError):
            pass  # the gateway hung up: what this test wants
        return resp


@functools.cache
def _bomb(size: int) -> bytes:
    """Compressed once per run, before any gateway waits on it (the attempt timeout)."""
    return gzip.compress(json.dumps(chat_completion(content="a" * size)).encode(), 6)


@pytest.fixture
def flood() -> Iterator[tuple[Flood, str]]:
    f = Flood()
    with serve(f.handle) as server:
        yield f, server.url


# the default bound of a request with n=1 and the workload's 256-token ceiling
DEFAULT_BOUND = 1 * MIB + 256 * 4096


@pytest.mark.parametrize("kind", ["chunked", "bomb", "declared"])
def test_a_flooding_answer_is_a_502_not_read_whole(
    flood: tuple[Flood, str], tmp_path: Path, kind: str
) -> None:
    _bomb(FLOOD_BYTES)
    config = _config(flood[1] + "/" + kind, tmp_path)
    with gateway(config) as gw, pytest.raises(openai.APIStatusError) as failed:
        _client(gw).chat.completions.create(model="fake-model", messages=MESSAGES)
    assert failed.value.status_code == 502
    assert f"more than {DEFAULT_BOUND} bytes" in failed.value.message
    assert _stopped_reading(flood[0].sent)
    rows = [json.loads(line) for line in _export(config, tmp_path).splitlines()]
    # it generated (and may bill) what it sent: held for reconciliation
    assert [r["state"] for r in rows] == ["usage_reconciliation_required"]


def test_a_flooding_stream_is_cut_at_its_bound(flood: tuple[Flood, str], tmp_path: Path) -> None:
    """A stream's bytes count in all (relayed ones too): past the bound, an error event."""
    config = _config(flood[1] + "/chunked", tmp_path)
    relayed = 0
    with gateway(config) as gw, pytest.raises(openai.APIError) as failed:
        for chunk in _client(gw).chat.completions.create(
            model="fake-model", messages=MESSAGES, stream=True
        ):
            relayed += len(chunk.choices[0].delta.content or "")
    assert "stream failed" in failed.value.message
    assert 0 < relayed <= DEFAULT_BOUND
    assert _stopped_reading(flood[0].sent)


def test_the_bound_is_configurable_per_route_and_globally(
    flood: tuple[Flood, str], tmp_path: Path
) -> None:
    config = _config(
        flood[1] + "/chunked",
        tmp_path,
        routes={"fake": {"max_answer_bytes": 200_000}},
        limits={"max_upstream_answer_bytes": 100_000},
    )
    assert config.routes["fake"].max_answer_bytes == 200_000  # the route's own wins
    assert config.routes["gem"].max_answer_bytes == 100_000  # the global one elsewhere
    with gateway(config) as gw, pytest.raises(openai.APIStatusError) as failed:
        _client(gw).chat.completions.create(model="fake-model", messages=MESSAGES)
    assert "more than 200000 bytes" in failed.value.message


def test_an_answer_within_its_bound_is_served(tmp_path: Path) -> None:
    """n=4 with 256 tokens each: 4 MiB + 1 MiB allowed, a 3 MiB answer goes through."""

    async def big(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response(chat_completion(n=4, content="y" * (768 * 1024)))

    with serve(big) as server, gateway(_config(server.url, tmp_path)) as gw:
        reply = _client(gw).chat.completions.create(
            model="fake-model", messages=MESSAGES, n=4, temperature=1
        )
    assert [len(c.message.content or "") for c in reply.choices] == [768 * 1024] * 4


async def _echo_in_answer(request: web.Request) -> web.StreamResponse:
    """A 200 whose generated text repeats the credential and the route's header."""
    body = json.loads(await request.read())
    creds = _credentials(request)
    if "streamgeneratecontent" in request.path.lower():
        return await sse(request, [gemini_answer(f"my key is {creds}")], done=False)
    if "generatecontent" in request.path.lower():
        return web.json_response(gemini_answer(f"my key is {creds}"))
    if body.get("stream"):
        return await sse(request, [chat_chunk(f"my key is {creds}"), chat_chunk("", finish="stop")])
    return web.json_response(chat_completion(content=f"my key is {creds}"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["fake-model", "gem-model"])
def test_a_credential_echoed_in_an_answer_is_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, stream: bool
) -> None:
    monkeypatch.setenv(GEMINI_KEY_ENV, GEMINI_KEY)
    with serve(_echo_in_answer) as echo, gateway(_config(echo.url, tmp_path)) as gw:
        client = _client(gw)
        if stream:
            chunks = client.chat.completions.create(model=model, messages=MESSAGES, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = client.chat.completions.create(model=model, messages=MESSAGES)
            text = reply.choices[0].message.content or ""
    assert text.startswith("my key is ") and "[redacted]" in text
    for secret in SECRETS:
        assert secret not in text
