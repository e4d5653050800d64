"""Runs the app under uvicorn with a graceful, zero-status exit on SIGINT / SIGTERM."""

from __future__ import annotations

import contextlib
import signal

import uvicorn


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


def run_server(app, host: str, port: int, log_level: str = "info", *,
               timeout_keep_alive: int = 5, timeout_graceful_shutdown: int = 5) -> None:
    """`timeout_keep_alive`: seconds an idle keep-alive connection stays open.
    `timeout_graceful_shutdown`: seconds the shutdown waits for responses to flush."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=timeout_graceful_shutdown)
    ae = getattr(getattr(app, "state", None), "async_engine", None)
    GracefulServer(config, ae.begin_shutdown if ae is not None else None).run()
