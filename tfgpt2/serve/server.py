"""uvicorn as `tfgpt2 serve` runs it: each connection's request must be in whole within a
deadline (`Protocol`), and SIGTERM's drain ends within a bound however clients behave
(`Server`)."""
import asyncio
import logging
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

GRACE = 5  # seconds that connections still open at shutdown get to finish writing before they are closed

log = logging.getLogger("uvicorn.error")


class Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline: a request's headers and body must be in
    whole within `request_timeout` seconds of the connection opening (or of its previous
    response ending), else the connection is closed. A client that stalls in its headers or
    body, or sends a byte every few seconds, holds its socket no longer than that."""

    def __init__(self, *args, request_timeout, **kwargs):
        super().__init__(*args, **kwargs)
        self.request_timeout, self.deadline = request_timeout, None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self):
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc):
        self.deadline.cancel()
        super().connection_lost(exc)

    def _arm(self):
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(self.request_timeout, self._expired)

    def _expired(self):
        """Close the connection unless its request is in whole (the app is answering it)."""
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY) or self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # the body's reader logs its own
            log.warning("%s: headers not in whole after %s s; connection closed", _client(self), self.request_timeout)
        self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or SIGINT (`app.state.draining`: new
    requests get 503) until no request is left or `drain_timeout` seconds have passed, then
    closing every connection (`shutdown`) and exiting 0; at once on a second signal. `ready()`
    is called once the port listens."""

    def __init__(self, config, app, scheduler, *, drain_timeout, ready=None):
        super().__init__(config)
        self.app, self.scheduler, self.drain_timeout, self.ready = app, scheduler, drain_timeout, ready
        self.drain_ends = None

    def handle_exit(self, sig, frame):
        if self.app.state.draining:
            self.should_exit = self.force_exit = True
        self.app.state.draining = True
        self.drain_ends = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter):
        if self.ready is not None:  # the first tick: the port listens
            self.ready, ready = None, self.ready
            ready()
        if self.app.state.draining and not self.should_exit:
            busy = self.app.state.active or not self.scheduler.idle
            if busy and time.monotonic() >= self.drain_ends:
                log.warning("the drain's %s s are over: the answers still running are cut off", self.drain_timeout)
                for run in list(self.app.state.runs):
                    run.cut_off()
            self.should_exit = not busy or time.monotonic() >= self.drain_ends
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None):
        """uvicorn's shutdown (idle connections closed, the others after their response),
        with connections still open after `GRACE` seconds closed: a client that does not read
        its response, or whose request was cut off, does not hold the process."""
        asyncio.get_running_loop().call_later(GRACE, self._close_connections)
        await super().shutdown(sockets)

    def _close_connections(self):
        for connection in list(self.server_state.connections):
            connection.transport.abort()


def _client(protocol):
    return "%s:%d" % protocol.client if protocol.client else "a client"


def config(app, *, host, port, log_level, request_timeout):
    """uvicorn's configuration of the server: h11 with `Protocol`'s deadline; its own
    graceful-shutdown bound a fallback behind `Server.shutdown`'s."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          http=lambda *args, **kwargs: Protocol(*args, request_timeout=request_timeout, **kwargs),
                          timeout_graceful_shutdown=2 * GRACE)
