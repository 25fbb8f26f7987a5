"""Which variables set which inductor flag, read from torch's config source (session 16).

Before, an environment variable that changed beside a config flag set in code was named as a possible
cause of the miss (torch's config entries keep a variable's value, not its name). Now torch's
`_inductor/config.py` is read (never imported or run) for the variables each flag's value reads: a
variable that sets none of the differing flags is a risk, not the cause; a flag the source does not map
keeps the old verdict (any variable may set it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from compilewatch.explain import envmap
from compilewatch.explain.explain import diff_parts, explain_run
from tests.test_explain_redteam_s14 import SCRIPT as S14_SCRIPT

ROOT = Path(__file__).resolve().parents[1]
BASE = {"env:recorded": ["1", "1"], "example_inputs[0]": ["a", "float32 [8, 8]"],
        "inductor_config[size_asserts]": ["t", "True"], "inductor_config[trace.enabled]": ["f", "False"]}


def test_the_installed_torchs_flags_map_to_the_variables_they_read():
    m = envmap.inductor_env_map()
    assert m["max_autotune"] == {"TORCHINDUCTOR_MAX_AUTOTUNE"}  # os.environ.get in the assignment
    assert "TORCHINDUCTOR_FX_GRAPH_CACHE" in m["fx_graph_cache"]  # Config(env_name_force=...)
    assert m["trace.enabled"] == {"TORCH_COMPILE_DEBUG"}  # a class's flag, under another name
    assert "TORCHINDUCTOR_COMPILE_THREADS" in m["compile_threads"]  # through decide_compile_threads()
    assert m["cpp.threads"] == frozenset()  # set in code only


def test_the_map_follows_functions_and_names_and_reads_only_literal_names():
    src = '''
import os
def _default():
    return os.environ.get("TORCHINDUCTOR_VIA_FUNCTION") == "1"
def _loop():
    return _loop()
_shared = os.environ.get("TORCHINDUCTOR_VIA_NAME", "0") == "1"
direct: bool = os.environ.get("TORCHINDUCTOR_DIRECT") == "1"
through_function = _default()
through_name = not _shared
self_ref = _loop()
made = os.environ.get("TORCHINDUCTOR_" + "BUILT")
plain = 3
class triton:
    cudagraphs = os.environ.get("TORCHINDUCTOR_CUDAGRAPHS") == "1"
    class inner:
        deep = _default()
'''
    m = envmap.env_map_of(src)
    assert m["direct"] == {"TORCHINDUCTOR_DIRECT"}
    assert m["through_function"] == {"TORCHINDUCTOR_VIA_FUNCTION"}
    assert m["through_name"] == {"TORCHINDUCTOR_VIA_NAME"}
    assert m["self_ref"] == frozenset() and m["plain"] == frozenset()
    assert m["made"] == frozenset()  # a name built at run time is not read: such a flag maps to nothing known
    assert m["triton.cudagraphs"] == {"TORCHINDUCTOR_CUDAGRAPHS"}
    assert m["triton.inner.deep"] == {"TORCHINDUCTOR_VIA_FUNCTION"}


def test_no_source_means_the_old_conservative_verdict(monkeypatch):
    monkeypatch.setattr(envmap, "inductor_env_map", lambda: {})
    other = dict(BASE, **{"inductor_config[size_asserts]": ["u", "False"], "env[TORCHINDUCTOR_FOO]": ["x", "1"]})
    assert not any(x.risk for x in diff_parts(BASE, other))


def test_unreadable_or_huge_source_gives_an_empty_map(tmp_path):
    bad = tmp_path / "config.py"
    bad.write_text("def (:\n")
    assert envmap._parsed(str(bad)) == {}
    big = tmp_path / "big.py"
    big.write_bytes(b"#" * (envmap.MAX_SOURCE + 1))
    assert envmap._parsed(str(big)) == {}
    assert envmap._parsed(str(tmp_path / "missing.py")) == {}


def test_a_variable_under_another_name_is_the_cause_an_unrelated_one_a_risk():
    debug = dict(BASE, **{"inductor_config[trace.enabled]": ["g", "True"], "env[TORCH_COMPILE_DEBUG]": ["x", "1"]})
    d = diff_parts(BASE, debug)
    assert d[0].part == "env[TORCH_COMPILE_DEBUG]" and not any(x.risk for x in d)
    both = dict(debug, **{"env[TORCHINDUCTOR_COMPILE_THREADS]": ["y", "1"]})
    d = diff_parts(BASE, both)
    assert [(x.part, x.risk) for x in d] == [("env[TORCH_COMPILE_DEBUG]", False), ("inductor_config[trace.enabled]", False),
                                            ("env[TORCHINDUCTOR_COMPILE_THREADS]", True)]


# the s14 red team's recording prologue (a function compiled in a child, one record run per `run(...)`)
SCRIPT = S14_SCRIPT[:S14_SCRIPT.index('\nrun("base"')] + r'''
run("base", torch.randn(8, 8), False)
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # read by inductor at import: changes nothing now
torch._inductor.config.size_asserts = not torch._inductor.config.size_asserts  # set in code
run("flag", torch.randn(8, 8), False)
record.stop()
'''


def test_a_real_miss_from_a_flag_set_in_code_beside_an_unrelated_variable(tmp_path):
    script = tmp_path / "scenario.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    e = next(x for x in explain_run(cache, run="flag").explanations if x.kind == "fxgraph")
    assert e.cause == "inductor config size_asserts", e.text
    risk = [d for d in e.diffs if d.part == "env[TORCHINDUCTOR_COMPILE_THREADS]"]
    assert risk and risk[0].risk and "a risk, not this miss's cause" in risk[0].text
