"""Limits on connections, below the HTTP API: a request head must arrive whole within a deadline
(a slowloris client is cut off), open connections are capped, and on a loopback address the
server answers only to loopback Host names (a DNS-rebinding page cannot drive it). Raw sockets
against the server as `nanoserve serve` runs it (server.build_server)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import ENGINE, NAME, free_port  # noqa: E402

from nanoserve import LLM  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402
from nanoserve.serve.middleware import allowed_hosts_for, host_name  # noqa: E402
from nanoserve.serve.server import build_server  # noqa: E402

HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def server():
    llm = LLM(progress=False, **ENGINE)
    app = build_app(AsyncEngine(llm.engine), NAME, allowed_hosts=allowed_hosts_for("127.0.0.1"))
    port = free_port()
    srv = build_server(app, "127.0.0.1", port, "warning", header_timeout_s=HEADER_TIMEOUT_S,
                       max_connections=MAX_CONNECTIONS)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    srv.port = port
    yield srv
    srv.should_exit = True
    thread.join(10)


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def status_and_body(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def request(server, host: str | None, path: str = "/health", version: str = "1.1") -> bytes:
    lines = [f"GET {path} HTTP/{version}", "connection: close"]
    if host is not None:
        lines.append(f"host: {host}")
    with connect(server) as s:
        s.sendall("\r\n".join(lines).encode() + b"\r\n\r\n")
        return read_until_closed(s)


def wait_for_no_connections(server) -> None:
    deadline = time.time() + 5
    while server.server_state.connections:
        assert time.time() < deadline, len(server.server_state.connections)
        time.sleep(0.02)


# --- the request head's deadline --------------------------------------------------------------

def test_a_head_left_unfinished_gets_408_and_is_closed_at_the_deadline(server):
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        start = time.perf_counter()
        data = read_until_closed(s)
        elapsed = time.perf_counter() - start
    assert HEADER_TIMEOUT_S - 0.1 <= elapsed <= HEADER_TIMEOUT_S + 1.0
    status, body = status_and_body(data)
    assert status == 408 and body["error"]["code"] == "request_timeout"


def test_a_head_trickled_byte_by_byte_is_cut_at_the_deadline_all_the_same(server):
    head = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-padding: " + b"a" * 100
    with connect(server) as s:
        start = time.perf_counter()
        s.settimeout(0.2)
        closed_at = None
        for byte in head:
            try:
                s.sendall(bytes([byte]))
                if s.recv(65536) == b"":
                    closed_at = time.perf_counter() - start
                    break
            except TimeoutError:
                continue  # still open: the next byte
            except OSError:  # reset while sending: closed
                closed_at = time.perf_counter() - start
                break
            else:  # a 408 arrived: read to the close
                s.settimeout(5)
                read_until_closed(s)
                closed_at = time.perf_counter() - start
                break
    assert closed_at is not None and closed_at <= HEADER_TIMEOUT_S + 1.0


def test_a_silent_connection_is_closed_at_the_deadline(server):
    with connect(server) as s:
        start = time.perf_counter()
        assert read_until_closed(s) == b""  # nothing was sent: closed without an answer
        assert time.perf_counter() - start <= HEADER_TIMEOUT_S + 1.0


def test_the_deadline_starts_again_after_each_response(server):
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        data = b""
        while b'"ok"' not in data:
            data += s.recv(65536)
        assert data.startswith(b"HTTP/1.1 200")
        start = time.perf_counter()
        s.sendall(b"GET /health HTTP/1.1\r\nho")  # the next head, never finished
        status, _ = status_and_body(read_until_closed(s))
        assert status == 408 and time.perf_counter() - start <= HEADER_TIMEOUT_S + 1.0


def read_response(s: socket.socket) -> bytes:
    """One response (its head and content-length bytes of body) off a connection kept open."""
    def more() -> bytes:
        chunk = s.recv(65536)
        assert chunk, "the server closed the connection"
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += more()
    return head + b"\r\n\r\n" + body


def test_an_idle_keep_alive_connection_outlives_the_head_deadline(server):
    """Between requests the keep-alive timeout (5 s here) rules, not the head's deadline."""
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")


def test_the_deadline_holds_after_an_answer_given_before_the_body(server):
    """An unknown route is answered before its body is read; the body, then a head that never
    ends, still meet the deadline."""
    with connect(server) as s:
        s.sendall(b"POST /nope HTTP/1.1\r\nhost: localhost\r\ncontent-length: 5\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 404")
        s.sendall(b"hello")
        time.sleep(0.2)
        start = time.perf_counter()
        s.sendall(b"GET /health HTTP/1.1\r\nho")
        data = read_until_closed(s)
        assert time.perf_counter() - start <= HEADER_TIMEOUT_S + 1.0
    assert data.startswith(b"HTTP/1.1 408"), data[:60]


def test_a_whole_head_is_not_cut_while_its_body_and_answer_take_longer(server):
    body = json.dumps({"prompt": "The sky", "max_tokens": 2, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
    with connect(server) as s:
        s.sendall(head.encode())
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        s.sendall(body)
        status, answer = status_and_body(read_until_closed(s))
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


# --- the cap on open connections ----------------------------------------------------------------

def test_connections_beyond_the_cap_get_503_and_are_closed(server):
    wait_for_no_connections(server)
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(server) as extra:
            status, body = status_and_body(read_until_closed(extra))
        assert status == 503
        assert body["error"]["code"] == "too_many_connections"
        assert body["error"]["type"] == "server_error"
        held[0].sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        assert read_until_closed(held[0]).startswith(b"HTTP/1.1 200")  # those held still work
    finally:
        for s in held:
            s.close()
    wait_for_no_connections(server)
    assert request(server, "127.0.0.1").startswith(b"HTTP/1.1 200")


# --- the Host header --------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:1",
                                  "[::1]", "[::1]:8000"])
def test_loopback_names_are_answered(server, host):
    status, body = status_and_body(request(server, host))
    assert (status, body) == (200, {"status": "ok"})


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "[::2]:80", "localhost:port",
                                  "[::1]x", None])
def test_other_host_names_get_400_in_openai_shape(server, host):
    data = request(server, host, "/v1/models", version="1.0" if host is None else "1.1")
    status, body = status_and_body(data)
    assert status == 400
    err = body["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None,
                                                        "invalid_host")
    assert "localhost, 127.0.0.1, ::1" in err["message"]


def test_allowed_hosts_default_to_loopback_names_on_loopback_addresses_only():
    loopback = ["localhost", "127.0.0.1", "::1"]
    assert allowed_hosts_for("127.0.0.1") == loopback
    assert allowed_hosts_for("localhost") == loopback
    assert allowed_hosts_for("::1") == loopback
    assert allowed_hosts_for("127.0.0.2") == loopback + ["127.0.0.2"]
    assert allowed_hosts_for("0.0.0.0") is None
    assert allowed_hosts_for("::") is None
    assert allowed_hosts_for("10.1.2.3") is None
    assert allowed_hosts_for("0.0.0.0", "api.example.com, *.corp.example") == [
        "api.example.com", "*.corp.example"]
    assert allowed_hosts_for("127.0.0.1", "*") is None
    with pytest.raises(ValueError, match="at least one name"):
        allowed_hosts_for("127.0.0.1", " , ")


def test_host_names_are_read_without_their_port():
    assert [host_name(h) for h in ("a.example:80", "A.Example", "[::1]:8000", "[::1]", "::1",
                                   "a:b", "[::1", ":80", "a:")] == [
        "a.example", "a.example", "::1", "::1", "::1", None, None, None, "a"]


def test_api_routes_work_through_the_guarded_server(server):
    r = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", timeout=60,
                   json={"prompt": "The sky", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(f"http://localhost:{server.port}/tokenize", json={"prompt": "The sky"})
    assert r.status_code == 200
