"""The HTTP/1.1 connections of `scalenlp serve`: uvicorn on its h11 protocol, with a deadline for reading each
request.

uvicorn closes a keep-alive connection that stays silent (``timeout_keep_alive``), but any byte cancels that
timer, and a fresh connection has none: a client that sends half a request's headers, or a body shorter than its
Content-Length, and then nothing, held its connection (and, for a body, the request's task) for ever. Here every
request must arrive whole within ``read_timeout`` seconds of the connection being ready for it (opened, or its
previous response sent), or the connection is closed; the app then sees the client leave, as with any disconnect.

h11, not httptools: the deadline reads h11's connection state, and one protocol keeps the behaviour the same
wherever uvicorn's optional extras are installed.
"""

from __future__ import annotations

import functools

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from scalenlp.serving.limits import ServeLimits


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request has not fully arrived ``read_timeout`` seconds
    after the connection could take it."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.read_deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may already have read the next (pipelined) request
        if not self.transport.is_closing():
            self._start_deadline()

    def connection_lost(self, exc) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
        super().connection_lost(exc)

    def _start_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
        self.read_deadline = self.loop.call_later(self.read_timeout, self._on_deadline)

    def _on_deadline(self) -> None:
        # IDLE: the request line or headers are missing (or nothing came); SEND_BODY: part of the body. Once the
        # request is whole (DONE) the deadline has no say: answering may take as long as the work does.
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.logger.info("closing a connection whose request did not arrive within %gs", self.read_timeout)
            self.transport.close()


def server_config(app, limits: ServeLimits, *, host: str, port: int, **kwargs):
    """``uvicorn.Config`` serving ``app`` under the connection deadlines of ``limits`` (reading a request, idle
    keep-alive, draining at shutdown); ``kwargs`` go to uvicorn."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port,
                          http=functools.partial(DeadlineH11Protocol, read_timeout=limits.read_timeout),
                          timeout_keep_alive=limits.keep_alive_timeout,
                          timeout_graceful_shutdown=limits.drain_timeout, **kwargs)
