"""Issue 31, untrusted input files: never block, work linear in the input, memory bounded, and a file
that is not what it claims is refused with one line.

CLI cases run in a child under a time and address-space limit (tests/limits.py); the property tests
run in process (derandomized Hypothesis) against the parsers themselves.
"""

from __future__ import annotations

import os
import random
import socket
import string
import sys
import tomllib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilewatch import inputs
from compilewatch.env.formats.requirements import parse_requirements
from compilewatch.env.formats.tomlutil import MAX_KEY_PARTS, load_toml
from compilewatch.errors import BadInput
from tests.limits import MiB, cli, one_clear_line, python

PROPS = settings(max_examples=40, deadline=5000, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
FREEZE = "torch==2.13.0\nnumpy==2.1.0\n"


@pytest.fixture
def freeze(tmp_path):
    p = tmp_path / "freeze.txt"
    p.write_text(FREEZE)
    return p


# --- files that are not regular files -------------------------------------------------------------
def test_diff_env_on_a_fifo_nobody_writes_returns_at_once(tmp_path, freeze):
    fifo = tmp_path / "env.fifo"
    os.mkfifo(fifo)
    one_clear_line(cli("diff-env", str(fifo), str(freeze), timeout=30), words="a FIFO nobody writes to")


def test_a_fifo_whose_writer_stays_silent_is_bad_input_after_the_wait(tmp_path, monkeypatch):
    fifo = tmp_path / "env.fifo"
    os.mkfifo(fifo)
    hold = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer open without blocking
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    os.close(hold)
    monkeypatch.setattr(inputs, "PIPE_WAIT_S", 0.2)
    try:
        with pytest.raises(BadInput, match="nothing arrived for 0.2 s"):
            inputs.read_text(fifo)
    finally:
        os.close(writer)


def test_a_pipe_with_data_is_read_like_process_substitution():
    r, w = os.pipe()
    os.write(w, FREEZE.encode())
    os.close(w)
    try:
        assert inputs.read_text(f"/dev/fd/{r}") == FREEZE
    finally:
        os.close(r)


def test_a_socket_is_bad_input(tmp_path):
    path = str(tmp_path / "s.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    try:
        with pytest.raises(BadInput, match="s.sock"):
            inputs.read_text(path)
    finally:
        s.close()


# --- TOML: dotted keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, head", [
    ("uv.lock", "version = 1\n[[package]]\nname = 'x'\n"),
    ("pylock.toml", "lock-version = '1.0'\n"),
])
def test_a_400kb_dotted_key_in_a_lock_file_is_refused_fast(tmp_path, freeze, name, head):
    p = tmp_path / name
    p.write_text(head + "a" + ".a" * 200_000 + " = 1\n")
    one_clear_line(cli("diff-env", str(p), str(freeze), timeout=30), words="more than 64 dotted parts")


def test_a_400kb_dotted_key_in_a_dflash_config_is_refused_fast(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text("[train]\n" + "k" + ".k" * 200_000 + " = 1\n")
    code = ("import sys\nfrom compilewatch import BadInput\nfrom dflash.config import load_toml\n"
            "try:\n    load_toml(sys.argv[1])\nexcept BadInput as e:\n    print('error:', e, file=sys.stderr); sys.exit(2)\n")
    one_clear_line(python(code, str(p), timeout=30), words="more than 64 dotted parts")


bare = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=8)
quoted = st.text(string.ascii_letters + ".#=[]{}, '", max_size=8).map(lambda s: '"' + s.replace('"', "") + '"')
keys = st.lists(bare | quoted, min_size=1, max_size=MAX_KEY_PARTS).map(".".join)
values = (st.integers(-10**6, 10**6).map(str) | st.floats(-1e6, 1e6, allow_nan=False).map(repr)
          | st.text(string.printable.replace("\\", "").replace('"', "").replace("\n", "").replace("\r", "")
                    .replace("\x0b", "").replace("\x0c", ""), max_size=20).map(lambda s: f'"{s}"')
          | st.just("1979-05-27T07:32:00.999999") | st.just("[1.5, 2.5, 'a.b.c']") | st.just("{ x.y = 1.5 }"))


@PROPS
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=6), st.booleans())
def test_toml_within_the_key_bound_reads_as_tomllib_reads_it(pairs, table):
    """No false refusals: any document whose keys have at most MAX_KEY_PARTS parts (dots inside
    strings, floats, dates, comments and inline tables included) reads exactly as tomllib reads it."""
    body = "".join(f"{k} = {v}  # a.b.c.d\n" for k, v in pairs)
    text = ("[t.u.v]\n" if table else "") + body
    try:
        want = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        with pytest.raises(BadInput):
            load_toml(text, "x.toml")
        return
    assert load_toml(text, "x.toml") == want


@PROPS
@given(st.integers(MAX_KEY_PARTS + 1, 5000), st.sampled_from(["{} = 1\n", "[{}]\n", "x = {{ {} = 1 }}\n"]))
def test_a_key_past_the_bound_is_refused_wherever_it_is(parts, shape):
    with pytest.raises(BadInput, match="dotted parts"):
        load_toml(shape.format(".".join(["a"] * parts)), "x.toml")


# --- YAML aliases -----------------------------------------------------------------------------------
def test_an_environment_yml_of_aliased_strings_is_refused_in_bounded_memory(tmp_path, freeze):
    """The issue's 1 MB file expanded to 2 GB; this 0.4 MB one would expand to 4 GB."""
    p = tmp_path / "environment.yml"
    p.write_text('x: &a "' + "y" * 100_000 + '"\ndependencies:\n' + "  - *a\n" * 40_000)
    one_clear_line(cli("diff-env", str(p), str(freeze), timeout=30, mem=1024 * MiB),
                   words="expand to more than 64 MiB of text")


# --- requirements ---------------------------------------------------------------------------------
def test_30k_requirement_lines_are_read_in_linear_time(tmp_path, freeze):
    p = tmp_path / "big.txt"
    p.write_text("".join(f"pkg{i}==1.{i}.0\n" for i in range(30_000)))
    o = cli("diff-env", str(freeze), str(p), "--json", timeout=60, mem=2048 * MiB)
    assert o.rc in (0, 1) and not o.traceback, o.stderr[-2000:]


def test_200k_continuation_lines_are_joined_once(tmp_path, freeze):
    p = tmp_path / "cont.txt"
    p.write_text("torch==2.13.0 \\\n" + "  --hash=sha256:00 \\\n" * 200_000 + "  --hash=sha256:00\n")
    one_clear_line(cli("diff-env", str(freeze), str(p), timeout=60), words="longer than any requirement")


@PROPS
@given(st.integers(0, 2 ** 32), st.integers(2_000, 20_000))
def test_random_printable_text_is_not_a_requirements_file(seed, size):
    rnd = random.Random(seed)
    text = "".join(rnd.choice(string.printable) for _ in range(size))
    with pytest.raises(BadInput, match="not a requirement"):
        parse_requirements(text, "noise.txt")


def test_a_20mb_single_line_is_one_short_message(tmp_path, freeze):
    p = tmp_path / "one-line.txt"
    p.write_text("a" * (20 * MiB))
    o = cli("diff-env", str(freeze), str(p), timeout=60, mem=1536 * MiB)
    one_clear_line(o, words="longer than any requirement")
    assert len(o.stdout) < 2000


def test_diff_output_quoting_a_file_stays_bounded(tmp_path, freeze):
    p = tmp_path / "long.txt"
    p.write_text("torch==2.13.0\nnumpy==2.2.0+" + "a" * 50_000 + "\n")
    o = cli("diff-env", str(freeze), str(p), "--fail-on", "critical", timeout=60)
    assert o.rc in (0, 1) and not o.traceback, o.stderr[-2000:]
    assert "numpy" in o.stdout and max(map(len, (o.stdout + o.stderr).splitlines())) <= 600


def test_a_file_with_a_few_bad_lines_is_still_read(tmp_path):
    env = parse_requirements("torch==2.13.0\nnumpy==2.1.0\nrich==13.0\nnot a requirement !!\n", "r.txt")
    assert {p.name for p in env.packages} == {"torch", "numpy", "rich"}
    assert any("r.txt:4" in n for n in env.notes)


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="FIFOs, /dev/fd and rlimits as on Linux")
