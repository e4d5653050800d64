"""Runs the app under uvicorn: a graceful, zero-status exit on SIGINT / SIGTERM, and two limits
on connections that uvicorn's h11 protocol lacks (a deadline for the request head, a cap on open
connections), so that slow or idle sockets cannot pile up."""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import signal
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve.serve.protocol import APIError

log = logging.getLogger("nanoserve.serve")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048
FD_RESERVE = 256  # descriptors kept for what is not a client connection (model files, threads)


def raw_error(e: APIError, reason: str) -> bytes:
    """A whole HTTP/1.1 response, written before any request was read (so not through h11),
    that closes the connection."""
    body = json.dumps(e.body()).encode()
    head = (f"HTTP/1.1 {e.status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n")
    head += "".join(f"{k}: {v}\r\n" for k, v in (e.headers or {}).items())
    return head.encode() + b"\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a request head must arrive whole within `header_timeout_s`
    of the connection's opening or of its first byte (a head that had started gets a 408, then
    the connection closes), and a connection beyond `max_connections` open ones gets a 503 and
    is closed at once. Both come from ServerConfig. An idle keep-alive connection between
    requests is uvicorn's: its keep-alive timer closes it."""

    header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        cap = self.config.max_connections
        if len(self.connections) > cap:
            e = APIError(503, f"the server has {cap} connections open, its limit; retry later",
                         code="too_many_connections", type_="server_error",
                         headers={"retry-after": "1"})
            transport.write(raw_error(e, "Service Unavailable"))
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # part of a new head is buffered (whatever came before it: a response, a body the
        # server answered early): its deadline runs from now, trickled bytes do not extend it
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_header_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request head is in
            self._cancel_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.config.header_timeout_s,
                                                     self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head: say why before closing
            e = APIError(408, f"request head not received within "
                              f"{self.config.header_timeout_s:g} s", code="request_timeout")
            self.transport.write(raw_error(e, "Request Timeout"))
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
            log.info("client %s: request head not received in time, connection closed",
                     client)
        self.transport.close()


class ServerConfig(uvicorn.Config):
    def __init__(self, app, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, **kw) -> None:
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        super().__init__(app, http=GuardedH11Protocol, **kw)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGINT / SIGTERM after its graceful shutdown, which kills the process
    with the signal; here the shutdown ends in a normal return instead. In-flight requests are
    aborted first, so their streams end with an error event and `data: [DONE]` (non-streaming
    ones get a 503) while uvicorn still lets responses flush; then the lifespan stops the
    engine thread. A second signal stops waiting for open connections."""

    def __init__(self, config: uvicorn.Config, on_shutdown=None) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # (tests) signals reach the main thread only
            return

        def stop(signum, frame) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        sigs = (signal.SIGINT, signal.SIGTERM)
        old = {sig: signal.signal(sig, stop) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets)


def fit_descriptor_limit(max_connections: int) -> int:
    """Raises the process's open-file limit to hold `max_connections` (up to its hard limit):
    past it, accept() fails and a connection cannot even be refused. Returns the cap that
    fits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        fit = max(1, soft - FD_RESERVE)
        log.warning("open-file limit %d: at most %d connections (not %d); raise ulimit -n",
                    soft, fit, max_connections)
        return fit
    return max_connections


def build_server(app, host: str, port: int, log_level: str = "info", *,
                 timeout_keep_alive: int = 5, timeout_graceful_shutdown: int = 5,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> GracefulServer:
    """`timeout_keep_alive`: seconds an idle keep-alive connection stays open.
    `timeout_graceful_shutdown`: seconds the shutdown waits for responses to flush.
    `header_timeout_s`: seconds a connection has to send a whole request head (from its opening
    or its previous response). `max_connections`: open connections; more are refused (503)."""
    config = ServerConfig(app, host=host, port=port, log_level=log_level,
                          timeout_keep_alive=timeout_keep_alive,
                          timeout_graceful_shutdown=timeout_graceful_shutdown,
                          header_timeout_s=header_timeout_s,
                          max_connections=fit_descriptor_limit(max_connections))
    ae = getattr(getattr(app, "state", None), "async_engine", None)
    return GracefulServer(config, ae.begin_shutdown if ae is not None else None)


def run_server(app, host: str, port: int, log_level: str = "info", *,
               timeout_keep_alive: int = 5, timeout_graceful_shutdown: int = 5,
               header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
               max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Serves until SIGINT / SIGTERM, under build_server's limits."""
    build_server(app, host, port, log_level, timeout_keep_alive=timeout_keep_alive,
                 timeout_graceful_shutdown=timeout_graceful_shutdown,
                 header_timeout_s=header_timeout_s, max_connections=max_connections).run()
