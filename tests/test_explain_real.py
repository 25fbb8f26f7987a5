"""Issue 38 on real compiles: every miss explained by the key part that changed, first.

Three fresh processes share one module-scoped fixture (a cold inductor compile takes seconds here):
`main` compiles a baseline and then changes one thing at a time (run id = the scenario; each change is
undone before the next, so every scenario's record differs from the baseline in that one thing):
an inductor config flag, the input dtype, the input shape (dynamic=False), the code, determinism,
and the cache dir (a sibling dir: the key is recorded in the first one). `env` runs the baseline with an
environment variable inductor reads (TORCHINDUCTOR_SIZE_ASSERTS=0); `again` runs it with nothing changed.
A different torch build is simulated by editing the recorded torch version part (test below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compilewatch.explain import store as S
from compilewatch.explain.explain import explain_run
from tests.redis_helpers import redis_server, redis_url  # noqa: F401 - fixtures: a real redis-server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

SCENARIOS = r'''
import json, os, sys
import torch
from compilewatch.explain import record

phase, cache_a, cache_b = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_a
rec = record.start(run=phase)


def make(body):
    ns = {}
    exec(compile(f"def f(x):\n    return {body}\n", "scenario_fn.py", "exec"), ns)
    return ns["f"]


f = make("(x.sin() + 1) * 2")
x = torch.randn(8, 8)


def run(name, fn, inp):
    rec.run = name
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, dynamic=False)(inp)


if phase == "main":
    run("baseline", f, x)
    run("repeat", f, x)
    with torch._inductor.config.patch(max_autotune=True):
        run("config", f, x)
    run("dtype", f, x.double())
    run("shape", f, torch.randn(16, 8))
    run("code", make("(x.cos() + 1) * 2"), x)
    torch.use_deterministic_algorithms(True)
    try:
        run("deterministic", f, x)
    finally:
        torch.use_deterministic_algorithms(False)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_b
    run("moved", f, x)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_a
else:
    run(phase, f, x)
print(json.dumps(record.stop()))
'''


def _run(script: Path, phase: str, a: Path, b: Path, **env: str) -> dict:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    p = subprocess.run([sys.executable, str(script), phase, str(a), str(b)], capture_output=True, text=True,
                       env=e, timeout=420, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    d = tmp_path_factory.mktemp("explain")
    script = d / "scenarios.py"
    script.write_text(SCENARIOS)
    a, b = d / "cache-a", d / "cache-b"
    summaries = {"main": _run(script, "main", a, b),
                 "env": _run(script, "env", a, b, TORCHINDUCTOR_SIZE_ASSERTS="0"),
                 "again": _run(script, "again", a, b)}
    return a, b, summaries


def _first(cache: Path, run: str):
    r = explain_run(cache, run=run)
    fx = [e for e in r.explanations if e.kind == "fxgraph"]
    assert fx, (run, r)
    return r, fx[0]


def test_the_hooks_of_this_torch_are_installed_and_removed(scenarios):
    _, _, s = scenarios
    assert sorted(s["main"]["hooks"]) == ["AOTAutogradCache._lookup", "ChromiumEventLogger.log_event_start/end",
                                          "FxGraphCache.load_with_key"]
    assert s["main"]["unsupported"] == [] and s["main"]["errors"] == 0


@pytest.mark.parametrize("run, verdict, first_part, words", [
    ("config", "changed", "inductor_config[max_autotune]", "inductor config max_autotune False → True"),
    ("dtype", "changed", "example_inputs[0]", "float32 [8, 8] stride (8, 1) cpu → float64 [8, 8]"),
    ("shape", "changed", "example_inputs[0]", "[16, 8]"),
    ("code", "changed", "gm", "graph code changed"),
    ("deterministic", "changed", "deterministic_algorithms_settings", "(False, False, True) → (True, False, True)"),
    ("env", "changed", "env[TORCHINDUCTOR_SIZE_ASSERTS]", "environment TORCHINDUCTOR_SIZE_ASSERTS unset → 0"),
])
def test_each_miss_names_the_part_that_changed_first(scenarios, run, verdict, first_part, words):
    a, _, _ = scenarios
    r, e = _first(a, run)
    assert r.misses >= 1 and e.verdict == verdict
    assert e.diffs[0].part == first_part, e.text
    assert words in e.text, e.text
    # the AOTAutograd miss of the same compile carries the same cause
    assert {x.cause for x in r.explanations} == {e.cause}


def test_a_moved_cache_dir_is_named(scenarios):
    a, b, _ = scenarios
    r, e = _first(b, "moved")
    assert e.verdict == "moved" and e.diffs[0].part == "cache dir"
    assert f"cache dir {a} → {b}" in e.text


def test_first_compile_is_a_new_graph_and_nothing_changed_means_hits_only(scenarios):
    a, _, _ = scenarios
    r, e = _first(a, "baseline")
    assert e.verdict == "new_graph" and "no entry of this code or name" in e.text
    for run in ("repeat", "again"):
        r = explain_run(a, run=run)
        assert r.lookups >= 2 and r.misses == 0 and r.hits == r.lookups and r.causes == ()


def test_entries_of_another_torch_build_are_named(scenarios, tmp_path):
    """Simulated: the baseline's records are rewritten as if another torch build made them (its torch
    version part and key edited); the unchanged `again` run's lookup then misses against them."""
    a, _, _ = scenarios
    data = S.read(S.store_dir(a))
    base = next(r for r in data.lookups if r["run"] == "baseline" and r["kind"] == "fxgraph")
    now = next(r for r in data.lookups if r["run"] == "again" and r["kind"] == "fxgraph")
    settings = dict(data.groups[base["groups"]["settings"]])
    settings["torch_version"] = ["0therbuild000000", None]
    settings["torch.__version__"] = ["", "2.99.0+other"]
    lines = []
    for gid, parts in data.groups.items():
        lines.append({"v": 1, "type": "group", "id": gid, "parts": parts})
    lines.append({"v": 1, "type": "group", "id": "edited", "parts": settings})
    lines.append({**base, "key": "fotherbuildkey", "groups": {**base["groups"], "settings": "edited"}, "run": "old"})
    lines.append({**now, "hit": False, "run": "new"})
    cache = tmp_path / "c"
    st = S.store_dir(cache)
    st.mkdir(mode=0o700)
    (st / S.FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    os.chmod(st / S.FILE, 0o600)
    r = explain_run(cache, run="new")
    e = r.explanations[0]
    assert e.diffs[0].part == "torch.__version__" and "2.99.0+other → " in e.text
    assert e.diffs[1].part == "torch_version"


def test_cache_explain_cli_on_the_last_run_and_against(scenarios):
    from typer.testing import CliRunner

    from cli.main import app

    a, b, _ = scenarios
    res = CliRunner().invoke(app, ["cache", "explain", "--dir", str(a), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["run"] == "again" and out["misses"] == 0
    res = CliRunner().invoke(app, ["cache", "explain", "--dir", str(b)])
    assert res.exit_code == 1 and "cache dir moved" in res.stdout
    res = CliRunner().invoke(app, ["cache", "explain", "--against", str(b), "--dir", str(a), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["would_hit"] >= 1


def test_against_a_dir_without_records_reads_the_stamps_torch_left_in_entries(scenarios, tmp_path):
    import shutil

    from compilewatch.explain.against import explain_against

    a, _, _ = scenarios
    other = tmp_path / "copied"
    shutil.copytree(a / "fxgraph", other / "fxgraph")
    rep = explain_against(other, a)
    assert rep.source == "entry stamps" and rep.entries >= 1
    # the copied entries were made here by this torch with several configs: some match, the others name the flag
    assert rep.would_hit >= 1
    assert any("max_autotune" in r.text or "size_asserts" in r.text for r in rep.results if not r.would_hit)


def _cli(*args: str):
    from typer.testing import CliRunner

    from cli.main import app

    return CliRunner().invoke(app, list(args))


def _retar(src: Path, dst: Path, *, drop: str | None = None, add: tuple[str, bytes] | None = None) -> None:
    """A copy of archive `src` (test-side), less member `drop`, with member `add` after the header."""
    import io
    import tarfile

    with tarfile.open(src, "r:gz") as tin, tarfile.open(dst, "w:gz") as tout:
        for i, m in enumerate(tin):
            if m.name != drop:
                tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
            if i == 0 and add is not None:
                info = tarfile.TarInfo(add[0])
                info.size = len(add[1])
                tout.addfile(info, io.BytesIO(add[1]))


def test_against_an_archive_reads_its_entries_stamps_through_the_verified_reader(scenarios, tmp_path):
    from compilewatch.explain.against import explain_against

    a, _, _ = scenarios
    arch = tmp_path / "a.tar.gz"
    res = _cli("cache", "save", str(arch), "--dir", str(a))
    assert res.exit_code == 0, res.output
    rep = explain_against(arch, a)
    assert rep.source == "archive entry stamps" and rep.entries >= 2 and rep.warnings == ()
    assert rep.would_hit >= 1  # the same entries, made here: those of this config match
    assert any("max_autotune" in r.text or "size_asserts" in r.text for r in rep.results if not r.would_hit)
    res = _cli("cache", "explain", "--against", str(arch), "--dir", str(a), "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["source"] == "archive entry stamps"  # some would miss
    # an unsigned copy is foreign: read all the same (nothing of it is run), and said so
    foreign = tmp_path / "foreign.tar.gz"
    _retar(arch, foreign, drop="signature.json")
    rep = explain_against(foreign, a)
    assert rep.entries >= 2 and "is foreign" in rep.warnings[0] and "only what its maker claims" in rep.warnings[0]


@pytest.mark.parametrize("bad", ["traversal", "not an archive"])
def test_against_a_bad_archive_is_one_clear_message_and_exit_2(scenarios, tmp_path, bad):
    a, _, _ = scenarios
    arch = tmp_path / "a.tar.gz"
    assert _cli("cache", "save", str(arch), "--dir", str(a)).exit_code == 0
    evil = tmp_path / "evil.tar.gz"
    if bad == "traversal":
        _retar(arch, evil, add=("cache/fxgraph/../../../escape", b"x"))
    else:
        evil.write_bytes(b"\x1f\x8b not really gzip")
    res = _cli("cache", "explain", "--against", str(evil), "--dir", str(a))
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and str(evil) in res.output
    assert not (tmp_path / "escape").exists()


def test_against_a_redis_server_reads_its_fxgraph_entries_stamps_never_unpickling(scenarios, redis_url, tmp_path):
    """A cluster's cold node: the shared Redis cache's FX-graph entries (torch's own value format, pushed
    here from this run's cache) judged against this machine by their stamps."""
    import redis

    from compilewatch.cache.remote.keyspace import encode_pickled, redis_key
    from compilewatch.explain.against import explain_against

    a, _, _ = scenarios
    client = redis.Redis.from_url(redis_url)
    pushed = 0
    for entry in (a / "fxgraph").rglob("*"):
        if entry.is_file():
            client.set(redis_key("fxgraph", entry.parent.name), encode_pickled(entry.read_bytes()))
            pushed += 1
    bad = "f" + "0" * 51
    client.set(redis_key("fxgraph", bad), b"\x80\x04 not torch's JSON")  # a malformed value: left out, said
    client.set("unrelated:key", b"x")
    client.close()
    assert pushed >= 2
    rep = explain_against(redis_url, a)
    assert rep.source == "remote entry stamps" and rep.entries == pushed
    assert rep.would_hit >= 1  # this run's entries, made here: those of this config match
    assert any("max_autotune" in r.text or "size_asserts" in r.text for r in rep.results if not r.would_hit)
    assert "what its writer claims" in rep.warnings[0] and any(bad in w for w in rep.warnings)
    res = _cli("cache", "explain", "--against", redis_url, "--dir", str(a), "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["source"] == "remote entry stamps"  # some would miss
    # a server that is not there: one clear message, exit 2
    res = _cli("cache", "explain", "--against", "redis://127.0.0.1:1", "--dir", str(a))
    assert res.exit_code == 2 and "Traceback" not in res.output and "127.0.0.1:1" in res.output
