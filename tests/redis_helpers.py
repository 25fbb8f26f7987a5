"""A real redis-server for the remote-cache tests (Debian's `redis-server`; .ci/run installs it).

`redis_server` (session scope) starts one on a free loopback port in a tmp dir with persistence off
(`--save '' --appendonly no`) and stops it at the end; `redis_url` (per test) empties it first. Under
pytest-xdist each worker is a session: it starts its own server, so no two workers share one.
`RedisServer.start(...)` starts more (a password, a server a test kills); a port taken before the server
binds it (by another worker) is replaced by another. `free_port()` is a port nothing listens on, kept
so until the test process exits (a dead server's URL). Without the binary the
tests that need it skip and say why; CI installs it, so there they run for real.
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

READY = b"Ready to accept connections"
START_TIMEOUT_S = 30.0


def _drain(pipe) -> None:
    while pipe.read(65536):
        pass


def redis_binary() -> str | None:
    return shutil.which("redis-server")


_RESERVED: list[socket.socket] = []  # the ports free_port() handed out, held bound until the process exits
PORT_TRIES = 20  # a server's port taken between our pick and its bind (another xdist worker): pick again


def free_port() -> int:
    """A loopback port where nothing listens, and where nothing can while this process lives: the port
    stays bound, never listening, by a socket held here (a connection to it is refused), so another
    test process (an xdist worker) that starts a server cannot be handed it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    return s.getsockname()[1]


def _unused_port() -> int:
    """A port free now, for a server to bind (it may be taken before the server binds: start retries)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortTaken(Exception):
    pass


class RedisServer:
    def __init__(self, proc: subprocess.Popen, port: int, password: str | None) -> None:
        self.proc, self.port, self.password = proc, port, password

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, workdir: Path, *extra: str, password: str | None = None) -> "RedisServer":
        binary = redis_binary()
        if binary is None:
            if os.environ.get("CI"):  # CI installs it (.ci/run): a missing server there is a failure, not a skip
                pytest.fail("redis-server is not installed: .ci/run's apt-get install redis-server did not work")
            pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run does)")
        workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(PORT_TRIES):
            port = _unused_port()
            args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(workdir), *extra]
            if password:
                args += ["--requirepass", password]
            try:
                return cls._start_on(args, port, password)
            except _PortTaken:
                continue
        raise RuntimeError(f"redis-server: {PORT_TRIES} free ports were taken before it could bind them")

    @classmethod
    def _start_on(cls, args: list[str], port: int, password: str | None) -> "RedisServer":
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        # ready when it says so (its log line), not after a sleep; dead when the pipe closes
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        seen = b""
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY not in seen:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                proc.kill()
                raise RuntimeError(f"redis-server did not start in {START_TIMEOUT_S} s: {seen[-500:]!r}")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                proc.wait()
                sel.close()
                proc.stdout.close()
                if b"Address already in use" in seen:
                    raise _PortTaken(port)
                raise RuntimeError(f"redis-server exited: {seen[-500:]!r}")
            seen += chunk
        sel.close()
        # it goes on logging to the pipe: drain it, so a full pipe never blocks the server
        threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
        return cls(proc, port, password)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    c = redis_server.client()
    c.flushall()
    c.close()
    return redis_server.url
