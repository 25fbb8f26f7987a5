"""Property-based fuzzing of every reader of untrusted input (issue 18).

For any input, each parser and loader returns a value or raises the project's `BadInput` (exit 2):
never another exception, and within bounded time and memory (inputs are small; readers cap sizes).
Two kinds of input per reader: arbitrary bytes/text, and real files of that format with one node
replaced by an arbitrary JSON value (structured mutations reach far deeper than random bytes).

CI determinism and budget: `derandomize=True` (the same examples every run), `deadline=None` (a
slow CI core is not a failure), and example counts sized for the whole module to run in about two
minutes on two cores.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilewatch.errors import BadInput

pytestmark = pytest.mark.filterwarnings("ignore")

FX = Path(__file__).parent / "fixtures" / "env"
FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                           max_leaves=16)


def _mutate(data, doc):
    """One to three nodes of `doc` (a JSON-like structure) replaced or dropped; returns a new doc."""
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutate_one(data, doc)
    return doc


def _mutate_one(data, doc):
    """Replace one node of `doc` with an arbitrary value (or drop one field); returns a new doc."""
    if not isinstance(doc, (dict, list)) or not doc or data.draw(st.integers(0, 3)) == 0:
        return data.draw(json_values)
    if isinstance(doc, dict):
        key = data.draw(st.sampled_from(sorted(doc, key=str)))
        if data.draw(st.integers(0, 3)) == 0:
            return {k: v for k, v in doc.items() if k != key}  # drop a field
        return {**doc, key: _mutate_one(data, doc[key])}
    i = data.draw(st.integers(0, len(doc) - 1))
    return doc[:i] + [_mutate_one(data, doc[i])] + doc[i + 1:]


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    return '""'


def _to_toml(doc) -> str:
    """A JSON-like dict as TOML (inline tables and arrays: equivalent to [[package]] sections)."""
    if not isinstance(doc, dict):
        doc = {"value": doc}
    return "".join(f"{json.dumps(str(k))} = {_toml_value(v)}\n" for k, v in doc.items() if v is not None)


def _only_bad_input(fn, *args):
    try:
        return fn(*args)
    except BadInput:
        return None


# --- environment formats --------------------------------------------------------------------------
REQ_FRAGMENTS = st.sampled_from([
    "torch==2.11.0+cu128", "-e .", ".", "./pkg", "git+https://h/x.git", "bzr+lp:x", "https://h/a-1.0.tar.gz",
    "--hash=sha256:ab", "-r other.txt", "--index-url", "x @ file:///w/x-1.0-py3-none-any.whl", "numpy>=1.26",
    "; python_version < '3'", "#egg=", "\\", "==", "[extra]", "-c", "@", "===", "*", "~=", "\t", " ",
])


@FAST
@given(st.text(max_size=300) | st.lists(REQ_FRAGMENTS | st.text(max_size=8), max_size=12).map(" ".join))
def test_requirements(text):
    from compilewatch.env.formats.requirements import parse_requirements

    _only_bad_input(parse_requirements, text, "r.txt")
    _only_bad_input(parse_requirements, text.replace(" -", "\n-"), "r.txt")


def _load_toml_fixture(rel):
    import tomllib

    return tomllib.loads((FX / rel).read_text())


@FAST
@given(st.data())
def test_uv_lock(data):
    from compilewatch.env.formats.uvlock import parse_uv_lock

    doc = _mutate(data, _load_toml_fixture("uv-project/uv.lock"))
    _only_bad_input(parse_uv_lock, _to_toml(doc), "uv.lock")


@FAST
@given(st.data())
def test_pylock(data):
    from compilewatch.env.formats.pylock import parse_pylock

    doc = _mutate(data, _load_toml_fixture("uv-project/pylock.toml"))
    _only_bad_input(parse_pylock, _to_toml(doc), "pylock.toml")


@FAST
@given(st.text(max_size=400))
def test_toml_formats_on_arbitrary_text(text):
    from compilewatch.env.formats.pylock import parse_pylock
    from compilewatch.env.formats.uvlock import parse_uv_lock

    _only_bad_input(parse_uv_lock, text, "uv.lock")
    _only_bad_input(parse_pylock, text, "pylock.toml")


@FAST
@given(st.data())
def test_conda_yaml(data):
    import yaml

    from compilewatch.env.formats.conda import parse_environment_yml

    doc = _mutate(data, yaml.safe_load((FX / "conda/environment.yml").read_text()))
    _only_bad_input(parse_environment_yml, yaml.safe_dump(doc), "environment.yml")
    _only_bad_input(parse_environment_yml, data.draw(st.text(max_size=200)), "environment.yml")


@FAST
@given(st.text(max_size=300))
def test_conda_explicit(text):
    from compilewatch.env.formats.conda import parse_conda_explicit

    _only_bad_input(parse_conda_explicit, text, "explicit.txt")
    _only_bad_input(parse_conda_explicit, "@EXPLICIT\n" + text, "explicit.txt")


@FAST
@given(st.data())
def test_our_lock_then_diff(data):
    """A mutated compilewatch lock either reads or is BadInput; one that reads also diffs."""
    from compilewatch.env.diff import diff_envs
    from compilewatch.env.formats.lockfile import parse_lock_file

    base = json.loads((FX / "seeds/old.lock.json").read_text())
    old = _only_bad_input(parse_lock_file, json.dumps(_mutate(data, base)), "old.lock.json")
    new = parse_lock_file((FX / "seeds/new.lock.json").read_text(), "new.lock.json")
    if old is not None:
        diff_envs(old, new)
        diff_envs(new, old)


@FAST
@given(st.binary(max_size=300))
def test_load_env_detects_and_reads_any_bytes(blob):
    from compilewatch.env.formats import load_env

    with tempfile.TemporaryDirectory() as d:
        for name in ("x.txt", "x.lock", "x.yml", "x.json", "pylock.toml"):
            p = Path(d) / name
            p.write_bytes(blob)
            _only_bad_input(load_env, p)


# --- watcher reports and the timeline -------------------------------------------------------------
EVENT_KEYS = ["kind", "time", "pid", "thread", "thread_id", "seq", "schema_version", "start", "end", "setters",
              "argv", "reasons", "threads_in_compile", "open_for_s", "name", "tracer", "target", "outer_window"]
events = st.dictionaries(st.sampled_from(EVENT_KEYS) | st.text(max_size=6), json_values, max_size=8)
kinds = st.sampled_from(["trace", "compile", "span", "flag_leak", "stall", "start", "end", "stuck_state",
                         "recompile_after_warm", "guard_blocked", "module_call_leak", "eager_fallback", "warm"])


@SLOW
@given(st.lists(st.tuples(kinds, st.floats(0, 10), events), max_size=6), st.binary(max_size=60))
def test_watch_report_and_timeline(rows, junk):
    from compilewatch.tracing.timeline import to_trace_events
    from compilewatch.tracing.watch_events import read_events, summarize

    lines = [json.dumps({"kind": k, "time": t, **e}) for k, t, e in rows]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "r.jsonl"
        for content in ("\n".join(lines).encode() + b"\n", junk, b"\n".join(x.encode() for x in lines[:1]) + junk):
            p.write_bytes(content)
            evs = _only_bad_input(read_events, p)
            if evs is not None:
                json.dumps(to_trace_events(evs), allow_nan=True)
                summarize(evs)


# --- cache archive and manifest -------------------------------------------------------------------
@FAST
@given(st.data())
def test_fingerprint_manifest_json(data):
    from compilewatch.cache.content import fingerprint as fp_mod

    base = {"format": 1, "path": "/c", "files": 1, "bytes": 3, "content_hash": "xxh3-128:0",
            "subcaches": [{"name": "fxgraph", "files": 1, "bytes": 3, "content_hash": "x", "newest_mtime_ns": 1}],
            "system_key": "k", "torch_version": "2.13.0", "created_at": "", "duration_s": 0.0, "hashed": 1,
            "reused": 0, "in_flight": 0, "entries": [{"rel": "fxgraph/ab/fab/e", "size": 3, "mtime_ns": 1, "hash": "h"}]}
    _only_bad_input(fp_mod.from_json, _mutate(data, base))


@pytest.fixture(scope="module")
def real_archive(tmp_path_factory):
    from compilewatch.cache.archive import save as archive_save
    from tests.cache_helpers import make_cache

    d = tmp_path_factory.mktemp("fuzzarch")
    archive_save.save(d / "a.tar", make_cache(d / "src", n_fx=2, n_codegen=2), mega=False)
    return (d / "a.tar").read_bytes()


def _members(raw: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        return [(m.name, t.extractfile(m).read()) for m in t.getmembers()]


def _tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@SLOW
@given(st.data())
def test_cache_archive_load(real_archive, data):
    """Mutated archives: a JSON member with one node replaced, a member's bytes or name replaced,
    or raw bytes flipped. Load into a fresh dir: a LoadResult or BadInput."""
    from compilewatch.cache.archive import load as archive_load

    members = _members(real_archive)
    how = data.draw(st.sampled_from(["json", "bytes", "name", "flip"]))
    i = data.draw(st.integers(0, len(members) - 1))
    name, content = members[i]
    if how == "json" and name.endswith(".json"):
        members[i] = (name, json.dumps(_mutate(data, json.loads(content))).encode())
    elif how == "bytes":
        members[i] = (name, data.draw(st.binary(max_size=200)))
    elif how == "name":
        members[i] = (data.draw(st.sampled_from(["cache/", "cache/a/../b", "x", "cache/qq", "cache/" + "n" * 300])
                                | st.text(max_size=20)), content)
    raw = _tar(members)
    if how == "flip":
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:pos] + bytes([raw[pos] ^ data.draw(st.integers(1, 255))]) + raw[pos + 1:]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "a.tar"
        p.write_bytes(raw)
        _only_bad_input(archive_load.load, p, Path(d) / "dst")


@FAST
@given(st.binary(max_size=400))
def test_picklescan_never_raises(blob):
    from compilewatch.cache.trust import picklescan

    r = picklescan.scan(b"\x80\x04" + blob)
    assert isinstance(r.refused, tuple)
    picklescan.strings(blob)


# --- dflash: config TOML, data JSONL, checkpoint metadata -----------------------------------------
@SLOW
@given(st.data())
def test_dflash_config_toml(data):
    import tomllib

    from dflash.config import load_toml, tiny, to_toml

    base = tomllib.loads(to_toml(tiny()))
    text = data.draw(st.sampled_from(["mutated", "text"]))
    body = _to_toml(_mutate(data, base)) if text == "mutated" else data.draw(st.text(max_size=200))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.toml"
        p.write_text(body)
        _only_bad_input(load_toml, p)


@SLOW
@given(st.lists(json_values.map(json.dumps) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")), max_size=6))
def test_dflash_data_jsonl(lines):
    from dflash.data.dataset import read_jsonl

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "d.jsonl"
        p.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape"))
        convs, warnings = read_jsonl(p)
        assert all(isinstance(c, list) for c in convs) and all(isinstance(w, str) for w in warnings)


@SLOW
@given(st.data())
def test_dflash_checkpoint_metadata(data):
    import torch

    from dflash.checkpoint import store as ckpt

    spec_cfg = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 16, "intermediate_size": 64, "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "sliding_window": None,
                "max_position_embeddings": 128, "block_size": 8, "num_target_layers": 4, "layer_types": ["full_attention"],
                "dflash_config": {"target_layer_ids": [1], "mask_token_id": 5}}
    _only_bad_input(ckpt.spec_from_config, _mutate(data, spec_cfg))
    state = _mutate(data, {"step": 1, "model": {}, "optimizer": {}, "spec": {"hidden_size": 32}})
    with tempfile.TemporaryDirectory() as d:
        if data.draw(st.booleans()):
            torch.save(state, Path(d) / ckpt.STATE_FILE)
        else:
            (Path(d) / ckpt.STATE_FILE).write_bytes(data.draw(st.binary(max_size=300)))
        _only_bad_input(ckpt.load_training_state, Path(d))
