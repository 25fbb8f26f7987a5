"""Issue 38 without compiling: parts, the store's format, bounds and trust, the hooks' lifecycle, the CLI's errors."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from cli.main import app
from compilewatch.explain import parts as P
from compilewatch.explain import store as S
from compilewatch.explain.explain import diff_parts, explain_run

LINES = [
    "[mjdeghhwqjdwamg6lerspuxivqw7zllcux3cauvg3syhqk5foam] gm: GraphModule()\n\ndef forward(self, x):\n    return x",
    "[m5zxsmvqtqqggw2ox2gw5s6fxjtvvpigtuuitm3uxdqegdfs4yt] example_inputs[0]: TensorMetadata(dtype=torch.float32, "
    "shape=torch.Size([8, 8]), stride=(8, 1), device=device(type='cpu'), layout=torch.strided, requires_grad=False)",
    "[esstihe2nyydk4mhzpvox3qkajyu5y5t23hk3fi2me7jn75xi3o] fx_kwargs[is_backward]: False",
    "[fdx5cz4ggwvfjsdb2mklcaxh377mbvtrurkqc6zegtwxcdkssoh] fx_kwargs[get_decomp_fn]: <function f at 0x7f017b281c60>",
    "[du4vyrfyozrfxcf6kk6ma7oqwatapifazeelfsawmsiu6gjdtxp] deterministic_algorithms_settings: (False, False, True)",
    "[sjldm5hyfytkdkxlfj3fhwi432gtpoqk3r6uo4z3lfs7aiipms3] torch_version: \x00\x9f binary",
    "[esstihe2nyydk4mhzpvox3qkajyu5y5t23hk3fi2me7jn75xi3o] inductor_config[max_autotune]: False",
]


def test_debug_lines_become_grouped_parts_with_short_values():
    g = P.parse_lines(LINES)
    assert g["graph"]["gm"] == ["mjdeghhwqjdwamg6", None]  # code: digest only
    assert g["graph"]["example_inputs[0]"][1] == "float32 [8, 8] stride (8, 1) cpu"
    assert g["kwargs"]["fx_kwargs[get_decomp_fn]"][1] == "<function f>"  # no address
    assert g["settings"]["torch_version"][1] is None
    assert g["config"]["inductor_config[max_autotune]"] == ["esstihe2nyydk4mh", "False"]


def test_differences_are_named_worst_first_and_unrecorded_values_say_so():
    before = {**P.parse_lines(LINES)["graph"], **P.parse_lines(LINES)["config"], "torch_version": ["aaaa", None]}
    after = dict(before, **{"inductor_config[max_autotune]": ["zzzz", "True"], "gm": ["cccc", None],
                            "torch_version": ["bbbb", None]})
    d = diff_parts(before, after)
    assert [x.part for x in d] == ["torch_version", "inductor_config[max_autotune]", "gm"]
    assert "value not recorded" in d[0].text and d[1].text == "inductor config max_autotune False → True"


def _write_store(cache, lines, mode=0o700):
    st = S.store_dir(cache)
    st.mkdir(parents=True, mode=mode)
    os.chmod(st, mode)
    (st / S.FILE).write_text("".join(json.dumps(x) + "\n" for x in lines))
    os.chmod(st / S.FILE, 0o600)
    return st


def _lookup(key, run, hit, gid="g1", **kw):
    return {"v": 1, "type": "lookup", "t": 1.0, "pid": 1, "run": run, "kind": "fxgraph", "key": key, "hit": hit,
            "name": "f", "backward": False, "compile_id": "0/0", "cache_dir": "/x", "torch": "t", "groups": {"graph": gid}, **kw}


def test_newer_format_and_torn_lines_are_skipped_not_guessed(tmp_path):
    cache = tmp_path / "c"
    st = _write_store(cache, [{"v": 1, "type": "group", "id": "g1", "parts": {"gm": ["a", None]}},
                              _lookup("k1", "r1", True), {"v": 2, "type": "lookup", "key": "k2"}])
    with open(st / S.FILE, "a") as f:
        f.write('{"v":1,"type":"lookup","ke')  # a torn last line
    data = S.read(st)
    assert len(data.lookups) == 1 and data.newer == 1 and data.skipped == 1
    r = explain_run(cache)
    assert any("newer format" in w for w in r.warnings) and r.hits == 1


def test_same_key_again_means_the_entry_is_gone(tmp_path):
    cache = tmp_path / "c"
    _write_store(cache, [{"v": 1, "type": "group", "id": "g1", "parts": {"gm": ["a", None]}},
                         _lookup("k1", "r1", False), _lookup("k1", "r2", False)])
    r = explain_run(cache)
    assert r.run == "r2" and r.explanations[0].verdict == "entry_gone" and "is gone from" in r.explanations[0].text


def test_same_key_missed_again_in_one_process_means_not_saved_yet(tmp_path):
    """Threads compiling one graph at once (`probe --threads`): the second lookup misses the key the
    first is still compiling; its entry is not gone, it was never written yet."""
    cache = tmp_path / "c"
    _write_store(cache, [{"v": 1, "type": "group", "id": "g1", "parts": {"gm": ["a", None]}},
                         _lookup("k1", "r1", False), _lookup("k1", "r1", False, t=1.4)])
    r = explain_run(cache)
    e = r.explanations[1]
    assert e.verdict == "not_saved" and "missed 0.4 s before in this process" in e.text
    assert r.explanations[0].verdict == "new_graph"


@pytest.mark.parametrize("what", ["dir", "file"])
def test_a_store_others_can_write_is_refused(tmp_path, what):
    cache = tmp_path / "c"
    st = _write_store(cache, [_lookup("k1", "r1", True)])
    os.chmod(st if what == "dir" else st / S.FILE, 0o777 if what == "dir" else 0o666)
    with pytest.raises(Exception) as e:
        S.read(st)
    assert "writable by other users" in str(e.value)
    res = CliRunner().invoke(app, ["cache", "explain", "--dir", str(cache)])
    assert res.exit_code == 2 and "refusing the key store" in res.output and "Traceback" not in res.output


def test_writer_appends_whole_lines_and_compacts_within_bounds(tmp_path):
    w = S.Writer(tmp_path / "c")
    assert oct(os.stat(w.store).st_mode & 0o777) == "0o700"
    w.append([{"v": 1, "type": "group", "id": "g1", "parts": {"gm": ["a", None]}}])
    for i in range(50):
        w.append([_lookup(f"k{i}", "r", True)])
    assert w.compact_if_needed(max_lookups=20, keep=10)
    data = S.read(w.store)
    assert [r["key"] for r in data.lookups] == [f"k{i}" for i in range(40, 50)] and set(data.groups) == {"g1"}
    assert not list(w.store.glob("*.tmp*"))
    w.close()


@pytest.mark.parametrize("args, message", [
    (["cache", "explain", "--dir", "NOPE"], "no key store"),
    (["cache", "explain", "REPORT_NOT_THERE.jsonl"], "REPORT_NOT_THERE"),
    (["cache", "explain", "--against", "NOPE_OTHER"], "no cache dir or archive at"),
    (["cache", "explain", "r.jsonl", "--against", "x"], "not both"),
])
def test_cli_bad_input_is_one_message_and_exit_2(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_a_report_without_cache_lookups_is_bad_input(tmp_path):
    rep = tmp_path / "w.jsonl"
    rep.write_text(json.dumps({"kind": "start", "time": 1, "pid": 1, "detail": {}}) + "\n")
    res = CliRunner().invoke(app, ["cache", "explain", str(rep)])
    assert res.exit_code == 2 and "records no cache lookups" in res.output


def test_watcher_installs_the_hooks_and_removes_them_at_close(tmp_path):
    import torch._inductor.codecache as cc
    from torch._functorch._aot_autograd import autograd_cache as ac

    from compilewatch.explain import record
    from compilewatch.tracing.watcher import Watcher

    from torch._dynamo.utils import ChromiumEventLogger as logger

    before = (cc.FxGraphCache.__dict__["load_with_key"], ac.AOTAutogradCache.__dict__["_lookup"],
              logger.__dict__["log_event_start"], logger.__dict__["log_event_end"])
    w = Watcher(tmp_path / "w.jsonl").install()
    try:
        assert record.installed()
        assert hasattr(cc.FxGraphCache.load_with_key, "__compilewatch_original__")
        assert hasattr(logger.log_event_start, "__compilewatch_original__")  # compile time by phase (part 4)
    finally:
        w.close()
    assert not record.installed()
    assert (cc.FxGraphCache.__dict__["load_with_key"], ac.AOTAutogradCache.__dict__["_lookup"],
            logger.__dict__["log_event_start"], logger.__dict__["log_event_end"]) == before
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert "cache_lookups" in kinds
