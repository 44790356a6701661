"""ncap's HTTP/1.1 front over raw sockets: keep-alive, pipelining, HTTP/1.0, Expect,
upgrades, idle connections, hand-over of other routes to aiohttp, and answers that carry
what aiohttp's own would."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httptools
import pytest
from aiohttp import web

from ncap.http import front
from ncap.http.app import create_app
from ncap.testing.fake_upstream import FakeState
from tests.support import ServerThread, gateway, gateway_config

CHAT = b"/v1/chat/completions"
BODY = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
STREAM_BODY = json.dumps(
    {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


def _request(
    path: bytes = CHAT, body: bytes = BODY, *, method: bytes = b"POST", extra: bytes = b""
) -> bytes:
    head = b"%s %s HTTP/1.1\r\nHost: localhost\r\n" % (method, path)
    if method == b"POST":
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return head + extra + b"\r\n" + (body if method == b"POST" else b"")


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False


class Reader:
    """Answers read off a socket with httptools' response parser, as they complete."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self.answers: list[Answer] = []
        self.closed = False

    def on_message_begin(self) -> None:
        self.answers.append(Answer())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.answers[-1].headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.answers[-1].status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.answers[-1].body += body

    def on_message_complete(self) -> None:
        self.answers[-1].complete = True

    def read(self, count: int, timeout: float = 10) -> list[Answer]:
        """Reads until ``count`` answers are whole (``count`` 0: one read)."""
        deadline = time.monotonic() + timeout
        first = True
        while (first or sum(a.complete for a in self.answers) < count) and not self.closed:
            first = False
            self._conn.settimeout(max(0.01, deadline - time.monotonic()))
            data = self._conn.recv(65536)
            if not data:
                self.closed = True
                self._parser.feed_data(b"")
                break
            self._parser.feed_data(data)
        return self.answers

    def wait_closed(self, timeout: float = 5) -> bool:
        self._conn.settimeout(timeout)
        try:
            while data := self._conn.recv(65536):
                self._parser.feed_data(data)
        except (TimeoutError, ConnectionResetError):
            return False
        self.closed = True
        return True


@pytest.fixture(scope="module")
def gw(
    fake: tuple[str, FakeState], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    with gateway(gateway_config(fake[0], tmp_path_factory.mktemp("front"))) as server:
        yield server


def _connect(server: ServerThread) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def test_pipelined_requests_are_answered_in_order_on_one_connection(gw: ServerThread) -> None:
    with _connect(gw) as conn:
        conn.sendall(_request() + _request(body=STREAM_BODY) + _request())
        answers = Reader(conn).read(3)
    assert [a.status for a in answers] == [200, 200, 200]
    assert [a.complete for a in answers] == [True, True, True]
    ids = [a.headers["x-request-id"] for a in answers]
    assert len(set(ids)) == 3 and ids == sorted(ids, key=lambda i: int(i.rsplit("-", 1)[1], 16))
    assert json.loads(answers[0].body)["object"] == "chat.completion"
    assert answers[1].headers["transfer-encoding"] == "chunked"
    assert answers[1].body.rstrip().endswith(b"data: [DONE]")
    assert json.loads(answers[2].body)["object"] == "chat.completion"


def test_a_body_sent_in_pieces_and_one_sent_chunked_are_read_whole(gw: ServerThread) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    head += b"Content-Type: application/json\r\n"
    with _connect(gw) as conn:
        reader = Reader(conn)
        conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10])
        time.sleep(0.2)
        conn.sendall(BODY[10:])
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (BODY[:7], BODY[7:30], BODY[30:]))
        conn.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        answers = reader.read(2)
    assert [a.status for a in answers] == [200, 200], [a.body for a in answers]


def test_http_1_0_is_answered_and_kept_only_when_asked(gw: ServerThread) -> None:
    one_oh = _request().replace(b"HTTP/1.1", b"HTTP/1.0")
    with _connect(gw) as conn:
        reader = Reader(conn)
        conn.sendall(one_oh)
        [answer] = reader.read(1)
        assert answer.status == 200 and "connection" not in answer.headers
        assert reader.wait_closed()
    kept = one_oh.replace(b"Host:", b"Connection: keep-alive\r\nHost:")
    with _connect(gw) as conn:
        reader = Reader(conn)
        conn.sendall(kept + kept)
        answers = reader.read(2)
        assert [a.status for a in answers] == [200, 200]
        assert answers[0].headers["connection"] == "keep-alive"
    stream = _request(body=STREAM_BODY).replace(b"HTTP/1.1", b"HTTP/1.0")
    with _connect(gw) as conn:  # a stream on HTTP/1.0: not chunked, ends with the connection
        reader = Reader(conn)
        conn.sendall(stream.replace(b"Host:", b"Connection: keep-alive\r\nHost:"))
        assert reader.wait_closed()
        [answer] = reader.answers
        assert answer.status == 200 and "transfer-encoding" not in answer.headers
        assert answer.body.rstrip().endswith(b"data: [DONE]")


def test_connection_close_is_honoured(gw: ServerThread) -> None:
    with _connect(gw) as conn:
        reader = Reader(conn)
        conn.sendall(_request(extra=b"Connection: close\r\n"))
        [answer] = reader.read(1)
        assert answer.status == 200 and answer.headers["connection"] == "close"
        assert reader.wait_closed()


def test_expect_100_continue_is_answered_before_the_body(gw: ServerThread) -> None:
    head = _request(extra=b"Expect: 100-continue\r\n")[: -len(BODY)]
    with _connect(gw) as conn:
        conn.sendall(head)
        interim = conn.recv(65536)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        conn.sendall(BODY)
        [answer] = Reader(conn).read(1)
    assert answer.status == 200
    with _connect(gw) as conn:  # refused before the body: no 100, and the connection ends
        reader = Reader(conn)
        conn.sendall(head.replace(b"Host: localhost", b"Host: example.com"))  # keyless: 403
        [answer] = reader.read(1)
        assert answer.status == 403 and answer.headers["connection"] == "close"
        assert reader.wait_closed()


def test_another_route_hands_the_connection_to_aiohttp(gw: ServerThread) -> None:
    """Pipelined: a completion (the front's), the models list (aiohttp's), then a
    streamed and a whole completion (aiohttp's, on the connection it now owns)."""
    with _connect(gw) as conn:
        reader = Reader(conn)
        models = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
        conn.sendall(_request() + models + _request(body=STREAM_BODY))
        time.sleep(0.1)
        conn.sendall(_request())
        answers = reader.read(4)
        assert not reader.closed
    assert [a.status for a in answers] == [200, 200, 200, 200]
    assert all("connection" not in a.headers for a in answers)
    assert json.loads(answers[1].body)["data"][0]["id"] == "fake-model"
    assert answers[2].body.rstrip().endswith(b"data: [DONE]")
    assert json.loads(answers[3].body)["object"] == "chat.completion"
    with _connect(gw) as conn:  # what the front would refuse, aiohttp reads and refuses
        reader = Reader(conn)
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert [a.status for a in reader.read(1)] == [200]
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n")
        answers = reader.read(2)
        assert [a.status for a in answers] == [200, 400]
        assert answers[1].headers["content-type"].startswith("text/plain")  # aiohttp's
    with _connect(gw) as conn:  # a body aiohttp reads as it comes, chunked or not
        reader = Reader(conn)
        head = b"POST /v1/models HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sendall(head + b"3\r\nabc\r\n")
        time.sleep(0.1)
        conn.sendall(b"0\r\n\r\n")
        [answer] = reader.read(1)
    assert answer.status == 405, answer.body
    assert json.loads(answer.body)["error"]["type"] == "invalid_request_error"


def test_an_upgrade_is_not_taken(gw: ServerThread) -> None:
    upgrade = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    upgrade += b"HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n"
    with _connect(gw) as conn:  # without a body: answered as HTTP/1.1, then closed
        reader = Reader(conn)
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + upgrade + b"\r\n")
        [answer] = reader.read(1)
        assert answer.status == 200 and json.loads(answer.body) == {"status": "ok"}
        assert reader.wait_closed()
    with _connect(gw) as conn:  # with one (llhttp would not read it): a 400
        reader = Reader(conn)
        conn.sendall(_request(extra=upgrade))
        [answer] = reader.read(1)
        assert answer.status == 400
        assert json.loads(answer.body)["error"]["type"] == "invalid_request_error"
        assert reader.wait_closed()


def test_idle_connections_are_closed(
    fake: tuple[str, FakeState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(front, "KEEPALIVE_S", 0.4)
    monkeypatch.setattr(front, "_SWEEP_S", 0.1)
    with gateway(gateway_config(fake[0], tmp_path)) as server, _connect(server) as conn:
        reader = Reader(conn)
        conn.sendall(_request())
        assert [a.status for a in reader.read(1)] == [200]
        started = time.monotonic()
        assert reader.wait_closed(timeout=5)
        assert 0.3 <= time.monotonic() - started < 3
        with _connect(server) as half:  # a head that never ends is idle too
            half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: loc")
            assert Reader(half).wait_closed(timeout=5)


def _by_aiohttp(config: object) -> ServerThread:
    """The same app served by aiohttp alone (no front)."""

    class Plain(ServerThread):
        async def _start(self) -> None:
            self.app = self._factory()
            self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=0.5)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            self.port = self._runner.addresses[0][1]

    return Plain(lambda: create_app(config, instance_id="test-gw")).start()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name, raw",
    [
        ("whole", _request()),
        ("stream", _request(body=STREAM_BODY)),
        ("refused", _request(body=b'{"model": "fake-model"}')),
        ("bad json", _request(body=b'{"model": ')),
        ("http/1.0", _request().replace(b"HTTP/1.1", b"HTTP/1.0")),
        ("close", _request(extra=b"Connection: close\r\n")),
    ],
)
def test_the_front_answers_with_what_aiohttp_wrote(
    name: str, raw: bytes, fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    """Status, header names and values (but ``Date`` and the ids) and body bytes (but
    ids and clocks) of one request, answered by the front and by aiohttp's server."""
    seen = []
    for which in ("front", "aiohttp"):
        config = gateway_config(fake[0], tmp_path / which)
        if which == "front":
            server = ServerThread(partial(create_app, config, instance_id="test-gw")).start()
        else:
            server = _by_aiohttp(config)
        try:
            with _connect(server) as conn:
                reader = Reader(conn)
                conn.sendall(raw)
                reader.read(1)
                if "connection" in reader.answers[0].headers or b"1.0" in raw[:20]:
                    reader.wait_closed()
                [answer] = reader.answers
        finally:
            server.stop()
        headers = {k: v for k, v in answer.headers.items() if k not in ("date", "x-request-id")}
        seen.append((answer.status, headers, _without_ids(answer.body)))
    assert seen[0] == seen[1], name


def _without_ids(body: bytes) -> bytes:
    body = re.sub(rb'"(id|created)":\s*("[^"]*"|\d+)', b'"\\1":0', body)
    return re.sub(rb"req-[0-9a-f]+-[0-9a-f]+", b"req", body)


def test_shutdown_lets_a_stream_in_flight_end_then_closes(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    """The runner's cleanup (SIGTERM in ``ncap serve``) waits for an answer being
    written, within the shutdown timeout; an idle connection is closed at once."""
    slow = {"fake": {"headers": {"x-fake-fault": "slow_chunks=20"}}}
    config = gateway_config(fake[0], tmp_path, routes=slow)
    server = ServerThread(partial(create_app, config, instance_id="test-gw")).start()
    stopper = threading.Thread(target=server.stop)
    try:
        with _connect(server) as idle, _connect(server) as conn:
            reader = Reader(conn)
            conn.sendall(_request(body=STREAM_BODY))
            while not (reader.answers and reader.answers[0].status):
                reader.read(0)  # the head and the first events
            stopper.start()
            [answer] = reader.read(1)
            assert answer.complete and answer.body.rstrip().endswith(b"data: [DONE]")
            assert reader.wait_closed()
            assert Reader(idle).wait_closed()
    finally:
        if stopper.ident is None:
            server.stop()
        else:
            stopper.join(30)


@pytest.mark.parametrize(
    "value",
    ["a\r\nInjected: yes", "a\nb", "a\rb", "a\x00b", "a\x1bb", "a\x7fb"],
    ids=["crlf", "lf", "cr", "nul", "esc", "del"],
)
def test_an_answer_header_with_a_control_character_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="control character"):
        front._head(200, {"Content-Type": "application/json", "x-value": value}, "")
    with pytest.raises(ValueError, match="control character"):
        front._head(200, {f"x-{value}": "v"}, "")


def test_an_answer_header_may_hold_a_tab_and_non_ascii_text() -> None:
    head = front._head(200, {"x-tab": "a\tb", "x-text": "café ✓"}, "Content-Length: 0\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK"
    assert "x-tab: a\tb" in lines and "x-text: café ✓" in lines
    assert head.endswith(b"\r\n\r\n") and head.count(b"\r\n") == len(lines) - 1
