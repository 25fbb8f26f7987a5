"""One network deadline per command: the time a `cache remote` command may spend waiting on the server,
connect and every read and write together, however the bytes arrive.

A socket timeout restarts with every byte received, so a server that drips one byte a second keeps a
client with a 30 s socket timeout reading for as long as it likes. Here the client's connections are
of a subclass (`bind`) whose connect, send and read run inside `Deadline.io()`: the time spent in
them is taken from one budget, and a watchdog thread shuts the connections down (`pool.disconnect()`)
the moment an operation has used the rest of it, which ends a blocked read at once. From then on
every operation fails immediately with `redis.exceptions.TimeoutError`. Local work (scanning
pickles) does not count: a large cache on a fast server is not cut short by its own checks.
"""

from __future__ import annotations

import threading
import time

from compilewatch.errors import BadInput

MAX_SECONDS = 7 * 86400.0  # a week: far past any push or pull, far below what threading and sockets take


class Deadline:
    """A budget of `seconds` of network waiting for one command."""

    def __init__(self, seconds: float, url: str = "the server") -> None:
        if not (isinstance(seconds, (int, float)) and 0 < seconds <= MAX_SECONDS):  # nan, inf: a thread traceback
            raise BadInput(f"--timeout must be a number of seconds > 0 and at most {MAX_SECONDS:g}, got {seconds!r}",
                           hint="leave --timeout out for the command's default (60 s for status/verify, 600 s for "
                                "push/pull/clear)")
        self.seconds = float(seconds)
        self.left = float(seconds)
        self.url = url
        self.expired = False
        self._pools: list = []
        self._cond = threading.Condition()
        self._until: float | None = None  # when the operation in progress runs out of budget
        self._depth = 0  # connect runs its handshake's reads inside it: one clock
        self._thread: threading.Thread | None = None

    # --- the budget -------------------------------------------------------------------------------
    def _error(self):
        import redis

        return redis.exceptions.TimeoutError(
            f"no complete answer within the {self.seconds:g} s network deadline of this command")

    def remaining(self) -> float:
        return max(0.0, self.left)

    def io(self):
        return _IO(self)

    def _enter(self) -> None:
        with self._cond:
            if self.expired or self.left <= 0:
                self.expired = True
                raise self._error()
            self._depth += 1
            if self._depth == 1:
                self._t0 = time.monotonic()
                self._until = self._t0 + self.left
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._watch, name="compilewatch-redis-deadline",
                                                    daemon=True)
                    self._thread.start()
                self._cond.notify_all()

    def _exit(self) -> bool:
        """True when the budget ran out during this operation."""
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self.left -= time.monotonic() - self._t0
                self._until = None
                self._cond.notify_all()
                if self.left <= 0:
                    self.expired = True
            return self.expired

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._until is None:
                    if not self._cond.wait(timeout=2.0) and self._until is None:
                        self._thread = None  # idle: the next operation starts a new watchdog
                        return
                    continue
                wait = self._until - time.monotonic()
                if wait > 0:
                    self._cond.wait(timeout=wait)
                    continue
                self.expired = True
                self._until = None
                pools = list(self._pools)
                break
        for pool in pools:  # outside the lock: disconnect wakes the reader, which then takes it
            try:
                pool.disconnect()
            except Exception:  # noqa: BLE001 - the reader fails either way, once the socket is gone
                pass
        with self._cond:
            self._thread = None

    # --- binding a client -------------------------------------------------------------------------
    def bind(self, client) -> None:
        """Make every connection `client`'s pool opens count against this deadline."""
        pool = client.connection_pool
        pool.connection_class = _deadline_class(pool.connection_class, self)
        with self._cond:
            self._pools.append(pool)


class _IO:
    __slots__ = ("d",)

    def __init__(self, d: Deadline) -> None:
        self.d = d

    def __enter__(self) -> None:
        self.d._enter()

    def __exit__(self, exc_type, exc, tb) -> bool:
        expired = self.d._exit()
        if expired and exc_type is not None:
            raise self.d._error() from None
        return False


def _deadline_class(base, deadline: Deadline):
    """`base` (redis-py's Connection, SSLConnection or UnixDomainSocketConnection) with its connect,
    send and read on `deadline`'s clock; the connect timeout is never more than what is left."""
    if getattr(base, "_compilewatch_deadline", None) is deadline:
        return base

    class DeadlineConnection(base):  # type: ignore[misc, valid-type]
        _compilewatch_deadline = deadline

        def connect(self, *args, **kwargs):
            with deadline.io():
                left = max(deadline.remaining(), 0.001)
                t = getattr(self, "socket_connect_timeout", None)
                self.socket_connect_timeout = left if t is None else min(t, left)
                return super().connect(*args, **kwargs)

        def send_packed_command(self, *args, **kwargs):
            with deadline.io():
                return super().send_packed_command(*args, **kwargs)

        def read_response(self, *args, **kwargs):
            with deadline.io():
                return super().read_response(*args, **kwargs)

    DeadlineConnection.__name__ = DeadlineConnection.__qualname__ = f"Deadline{base.__name__}"
    return DeadlineConnection
