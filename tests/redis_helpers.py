"""A real redis-server for the remote-cache tests (Debian's `redis-server`; .ci/run installs it).

`redis_server` (session scope) starts one on a free loopback port in a tmp dir with persistence off
(`--save '' --appendonly no`) and stops it at the end; `redis_url` (per test) empties it first.
`RedisServer.start(...)` starts more (a password, a server a test kills). Without the binary the
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir), *extra]
        if password:
            args += ["--requirepass", password]
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
