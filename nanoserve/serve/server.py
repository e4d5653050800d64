"""Runs the app under uvicorn with a graceful, zero-status exit on SIGINT / SIGTERM."""

from __future__ import annotations

import contextlib
import signal

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGINT / SIGTERM after its graceful shutdown, which kills the process
    with the signal; here the shutdown (in-flight requests aborted, engine thread joined) ends
    in a normal return instead. A second signal stops waiting for open connections."""

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


def run_server(app, host: str, port: int, log_level: str = "info") -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    GracefulServer(config).run()
