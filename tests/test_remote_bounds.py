"""`cache remote`: reads bounded in time (one network deadline per command, not a timeout per byte) and
in depth (a planted value is a finding naming its key, never a RecursionError); bad URLs and missing
passwords said as what they are (issue 37, items 2, 3 and 5)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from cli.main import app
from compilewatch.cache.remote import keyspace as remote_keys
from compilewatch.cache.remote import server as remote
from compilewatch.cache.remote import sync as remote_sync
from compilewatch.errors import BadInput
from tests.helpers import invoke, invoke_json
from tests.redis_helpers import RedisServer

DRIP_EVERY_S = 0.05  # one byte per 50 ms: each socket read gets a byte long before any per-read timeout
DRIP_MAX_BYTES = 4000  # the server stops by itself after this (200 s), whatever the client does


class DripServer:
    """A TCP server on 127.0.0.1 that answers every connection with a Redis bulk string announced as
    1 MB and sent one byte at a time, forever (until `stop`, the client leaving, or DRIP_MAX_BYTES)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.connected = threading.Event()  # a client connected and got its first byte
        self.sent = 0
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "DripServer":
        self._accept.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._accept.join(timeout=10)
        for t in self._threads:
            t.join(timeout=10)
        self.sock.close()
        assert not self._accept.is_alive() and not any(t.is_alive() for t in self._threads)

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            t = threading.Thread(target=self._drip, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(1.0)
            try:
                conn.recv(65536)  # the client's first command (HELLO / PING)
            except OSError:
                return
            reply = b"$1000000\r\n"
            i = 0
            while not self.stop.is_set() and self.sent < DRIP_MAX_BYTES:
                try:
                    conn.sendall(reply[i:i + 1] if i < len(reply) else b"x")
                except OSError:
                    return  # the client hung up: what the deadline does
                i += 1
                self.sent += 1
                self.connected.set()
                self.stop.wait(DRIP_EVERY_S)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.mark.parametrize("command", ["status", "verify"])
def test_a_dripping_server_meets_one_deadline_per_command(command):
    with DripServer() as srv:
        t0 = time.monotonic()
        res = invoke(app, ["cache", "remote", command, srv.url, "--timeout", "1.5"])
        took = time.monotonic() - t0
        assert srv.connected.is_set()  # it did connect and receive bytes: the deadline, not a refusal, ended it
    assert took < 15, took  # a per-byte timeout would read for DRIP_MAX_BYTES * DRIP_EVERY_S = 200 s
    assert "Traceback" not in res.stderr
    out = res.stdout + res.stderr
    assert "network deadline" in out, out
    assert res.exit_code == (1 if command == "status" else 2)


def test_the_deadline_is_one_budget_for_connect_and_every_read():
    with DripServer() as srv:
        t0 = time.monotonic()
        with pytest.raises(BadInput, match="network deadline"):
            remote.connect(srv.url, deadline=1.0)
        assert time.monotonic() - t0 < 10
        r = remote.probe(srv.url, timeout=0.5)  # what doctor and a watched process's exit report use
        assert not r.reachable and "deadline" in r.why


# --- depth and size -------------------------------------------------------------------------------
FX = remote_keys.redis_key("fxgraph", "f" + "q" * 51)
AUTOTUNE = "pt2:" + "0" * 64 + "::kernel:c1"


def test_a_deeply_nested_value_is_a_finding_naming_its_key(tmp_path, redis_url, redis_server):
    c = redis_server.client()
    c.set(FX, b"[" * 100_000)
    c.set(AUTOTUNE, b"{" * 50_000)
    v = invoke_json(app, ["cache", "remote", "verify", redis_url], expect_code=1)
    bad = {f["key"]: f for f in v["findings"] if f["kind"] == "malformed"}
    assert set(bad) == {FX, AUTOTUNE} and all("nested deeper" in f["detail"] for f in bad.values())
    s = invoke_json(app, ["cache", "remote", "status", redis_url])
    assert s["problems"] == {"malformed": 2} and {k[0] for k in s["problem_keys"]} == {FX, AUTOTUNE}
    res = invoke(app, ["cache", "remote", "status", redis_url])
    assert res.exit_code == 0 and FX in res.stderr and "Traceback" not in res.stderr
    p = invoke_json(app, ["cache", "remote", "pull", "--url", redis_url, "--dir", str(tmp_path / "c")])
    assert p["pulled"] == {} and any(sk["what"] == FX and "nested deeper" in sk["reason"] for sk in p["skipped"])


def test_bounded_json_decoding():
    for bad in (b"[" * 100_000, b'{"a":' * 40 + b"1" + b"}" * 40, b"[[]," * 200_000 + b"[]" + b"]" * 200_000):
        with pytest.raises(ValueError):
            remote_keys.decode_value(bad)
    assert remote_keys.decode_value(b'{"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\"[[[", "n": [[1]]}')["n"] == [[1]]
    assert remote_keys.json_shape_problem(remote_keys.encode_pickled(b"\x80" * 100_000)) is None


def test_a_crafted_backup_line_is_bad_input(tmp_path, redis_url):
    b = tmp_path / "x.jsonl"
    b.write_bytes(b'{"format": "compilewatch-remote-backup", "version": 1}\n' + b"[" * 100_000 + b"\n")
    res = invoke(app, ["cache", "remote", "push", str(b), "--url", redis_url])
    assert res.exit_code == 2 and "not a backup row" in res.stderr and "Traceback" not in res.stderr
    with pytest.raises(BadInput):
        list(remote_sync.read_backup(b))


# --- what the message says --------------------------------------------------------------------------
def test_no_password_given_is_not_a_refused_password(tmp_path):
    srv = RedisServer.start(tmp_path / "pw", password="s3cret")
    try:
        for args in (["verify", f"redis://127.0.0.1:{srv.port}"], ["clear", f"redis://127.0.0.1:{srv.port}"]):
            res = invoke(app, ["cache", "remote", *args])
            assert res.exit_code == 2 and "the server wants a password; none was given" in res.stderr, res.stderr
            assert "refused the password" not in res.stderr
        wrong = invoke(app, ["cache", "remote", "verify", srv.url.replace("s3cret", "nope")])
        assert wrong.exit_code == 2 and "refused the password" in wrong.stderr and "nope" not in wrong.stderr
        s = invoke_json(app, ["cache", "remote", "status", f"redis://127.0.0.1:{srv.port}"], expect_code=1)
        assert "none was given" in s["reach"]["why"]
    finally:
        srv.stop()


@pytest.mark.parametrize("command", ["status", "verify", "clear"])
def test_a_wrong_scheme_is_bad_input_not_unreachable(command, monkeypatch):
    res = invoke(app, ["cache", "remote", command, "http://127.0.0.1:6379"])
    assert res.exit_code == 2 and "not a Redis URL" in res.stderr and "redis://" in res.stderr, res.stderr
    assert "unreachable" not in res.stderr and "Traceback" not in res.stderr
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", "http://127.0.0.1:6379")
    env = invoke(app, ["cache", "remote", command])
    assert env.exit_code == 2 and "TORCHINDUCTOR_REDIS_URL" in env.stderr and "unreachable" not in env.stderr


@pytest.mark.parametrize("cmd", [["status"], ["verify"], ["clear"], ["pull"], ["push", "SRC"]])
def test_every_remote_command_takes_the_url_either_way(cmd, tmp_path):
    """One convention: the server is the URL argument or --url, on all five commands; both at once must
    agree. (A URL of another scheme is bad input either way: no server is contacted.)"""
    from cli.main import app
    from tests.helpers import invoke

    args = [tmp_path / "src" if a == "SRC" else a for a in cmd]
    (tmp_path / "src").mkdir()
    for form in (["http://127.0.0.1:9"], ["--url", "http://127.0.0.1:9"]):
        r = invoke(app, ["cache", "remote", *map(str, args), *form])
        assert r.exit_code == 2 and "redis://" in r.stderr and "No such option" not in r.stderr, (form, r.stderr)
        assert "Got unexpected extra argument" not in r.stderr
    r = invoke(app, ["cache", "remote", *map(str, args), "redis://127.0.0.1:9", "--url", "redis://127.0.0.1:8"])
    assert r.exit_code == 2 and "two servers given" in r.stderr
