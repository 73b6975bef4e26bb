"""uvicorn, as `ktrun serve` runs it: the connection protocol (read deadlines, a header size limit) and the server
(a graceful drain on SIGTERM/SIGINT).

    connection_protocol(...)  uvicorn's h11 connection with read deadlines and 431. h11, not httptools: h11 frames a
                              stream for an HTTP/1.0 client without chunked encoding (the body ends when the
                              connection closes, `Connection: close`), and bounds the request head it buffers
                              (uvicorn's h11_max_incomplete_event_size; httptools buffers any size).
    DrainingServer            uvicorn's Server whose shutdown lets running requests finish up to the drain timeout,
                              then ends the rest with an error (streams: an error event and [DONE]; others: 503).
"""
from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from .responses import error_body

DEFAULT_HEADER_TIMEOUT = 60.0    # nginx's client_header_timeout
DEFAULT_BODY_TIMEOUT = 60.0      # nginx's client_body_timeout (between two reads of the body)
DEFAULT_KEEP_ALIVE_TIMEOUT = 30.0  # idle keep-alive connections (uvicorn 5 s, nginx 75 s): longer than client pools
                                 # keep idle connections (httpx 5 s), so none is closed just as a client reuses it
DEFAULT_MAX_HEADER_BYTES = 128 << 10   # request line + headers (h11 16 KiB, nginx 4 x 8 KiB; big tokens/cookies fit)
DEFAULT_MAX_CONNECTIONS = 1024   # uvicorn's limit_concurrency: beyond it, requests get 503 (nginx's worker_connections)
DEFAULT_DRAIN_TIMEOUT = 10.0


def _error_bytes(status: int, message: str, code: str) -> bytes:
    return json.dumps(error_body(message, "invalid_request_error", code)).encode()


class _LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 connection plus read deadlines, which uvicorn lacks (its only timer is the idle keep-alive one,
    so a client that connects and sends nothing, or a head or body a byte at a time, holds its connection forever):
    the request head must arrive within header_timeout of the connection opening (or of its first byte on a kept-alive
    connection), and the body may pause at most body_timeout between two reads. A head over max_header_bytes gets 431
    (uvicorn answers every h11 error with 400)."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    body_timeout = DEFAULT_BODY_TIMEOUT
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    _deadline: asyncio.TimerHandle | None = None
    _phase = ""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm("head")

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        self._disarm()                  # idle now: the keep-alive timer's turn (uvicorn)
        super().on_response_complete()
        if self.conn.their_state is not h11.IDLE:   # a pipelined request went on
            self._follow_request()

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if self.transport.is_closing():
            self._disarm()
        elif state is h11.IDLE:         # a head has begun (or is awaited): one deadline for all of it
            if self._phase != "head" and self.conn.trailing_data[0]:
                self._arm("head")
        elif state is h11.SEND_BODY:    # every read of the body restarts its deadline
            self._arm("body")
        else:
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        seconds = self.header_timeout if phase == "head" else self.body_timeout
        self._deadline = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _timed_out(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, ""
        if self.transport.is_closing():
            return
        if phase == "body" and self.flow.read_paused:   # the app has not read what came: not the client's delay
            self._arm("body")
            return
        if phase == "head" and self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE:
            self._send_error(408, f"the request head did not arrive within {self.header_timeout:g} s "
                                  f"(--header-timeout)", "request_timeout")
        else:   # a body stalled: the app sees the client gone (http.disconnect) and stops
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) > self.max_header_bytes:    # h11's max_incomplete_event_size was hit
            self._send_error(431, f"the request head is over {self.max_header_bytes} bytes (--max-header-bytes)",
                             "header_too_large")
        else:
            super().send_400_response(msg)

    def _send_error(self, status: int, message: str, code: str) -> None:
        body = _error_bytes(status, message, code)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:   # a response had begun: nothing more can be said
            pass
        self.transport.close()


def connection_protocol(header_timeout: float, body_timeout: float, max_header_bytes: int) -> type:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("KtrunH11Protocol", (_LimitedH11Protocol,), {
        "header_timeout": header_timeout, "body_timeout": body_timeout, "max_header_bytes": max_header_bytes})


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting, closes idle connections and waits for running requests
    (timeout_graceful_shutdown, here drain_timeout + 1 s as a backstop). At drain_timeout this ends the requests still
    generating (state.end_generations: streams get an error event and [DONE], others a 503), and a moment later closes
    whatever connection is left (a body still arriving), so uvicorn never cancels a task mid-stream. A second signal:
    everything ends at once and uvicorn stops waiting (`forced`)."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self.forced = False

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and not self.forced:     # the second signal (uvicorn forces only on a second SIGINT)
            self.forced = self.force_exit = True
            if self.state.loop is not None:
                self.state.loop.call_soon_threadsafe(self._end_now)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True                   # new requests on open connections: 503
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self._end_now)
        try:
            await super().shutdown(sockets)
            if self.forced:          # uvicorn skips it when forced, and the lifespan task dies cancelled (a traceback)
                await self.lifespan.shutdown()
        finally:
            timer.cancel()

    def _end_now(self) -> None:
        self.state.end_generations()
        asyncio.get_running_loop().call_later(0.5, self._close_connections)

    def _close_connections(self) -> None:
        for conn in list(self.server_state.connections):
            conn.transport.close()
