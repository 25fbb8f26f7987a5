"""The cache commands on a real inductor cache, made once per session by CPU inductor in a subprocess.

The subprocess keeps dynamo state and TORCHINDUCTOR_CACHE_DIR out of the test process; it compiles
one tiny function forward + backward (2 FX graphs, 1 AOTAutograd entry, C++ kernels).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from compilewatch import torchinfo
from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.content import fingerprint as fp_mod
from compilewatch.cache.content import stamps
from compilewatch.cache.content import verify as verify_mod
from compilewatch.cache.local import layout

SCRIPT = '''
import json
import torch
from torch._dynamo.utils import counters


def f(x, y):
    return (x.sin() + y.cos()).relu().sum(dim=-1)


x = torch.randn(8, 16, requires_grad=True)
y = torch.randn(8, 16)
torch.compile(f)(x, y).sum().backward()
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
out = {k: dict(counters[k]) for k in ("inductor", "aot_autograd")}
print(json.dumps({**out, "default_cache_dir": default_cache_dir()}))
'''


def compile_env() -> dict[str, str]:
    """This process's environment for a compiling child, less the test's own inductor and triton dirs
    (the child is given its own); the vector-ISA setting (tests/conftest.py) stays."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("TORCHINDUCTOR_", "TRITON_")) or k == "TORCHINDUCTOR_VEC_ISA_OK"}


def compile_into(cache_dir: Path, script_dir: Path, tmp_root: Path | None = None) -> dict:
    """Compile SCRIPT into `cache_dir` in a subprocess. TMPDIR is `tmp_root` (default
    `script_dir/tmp`): torch's default dir, where it writes precompiled headers whatever
    TORCHINDUCTOR_CACHE_DIR says, is `tmp_root/torchinductor_<user>`, not the machine's /tmp."""
    script = script_dir / "compile_one.py"
    script.write_text(SCRIPT)
    tmp_root = tmp_root or script_dir / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    env = compile_env()
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_COMPILE_THREADS="1", TMPDIR=str(tmp_root))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class RealCompile(NamedTuple):
    cache: Path  # TORCHINDUCTOR_CACHE_DIR of the compile
    default_dir: Path  # torch's default dir in that process (holds precompiled_headers/)
    tmp_root: Path


@pytest.fixture(scope="session")
def real_compile(tmp_path_factory) -> RealCompile:
    base = tmp_path_factory.mktemp("real-cache")
    counts = compile_into(base / "inductor", base)
    assert counts["inductor"].get("fxgraph_cache_miss", 0) >= 1
    return RealCompile(base / "inductor", Path(counts["default_cache_dir"]), base / "tmp")


@pytest.fixture(scope="session")
def real_cache(real_compile) -> Path:
    return real_compile.cache


@pytest.fixture
def cache_copy(real_cache, tmp_path) -> Path:
    dst = tmp_path / "cache"
    shutil.copytree(real_cache, dst, ignore=shutil.ignore_patterns(layout.SIDECAR))
    return dst


def test_real_cache_layout_and_fingerprint(cache_copy):
    fp = fp_mod.fingerprint(cache_copy, files=True)
    subs = {s.name: s for s in fp.subcaches}
    assert subs["fxgraph"].files == 2 and subs["aotautograd"].files == 1
    assert subs["codegen"].files >= 2 and any(e.rel.endswith(".so") for e in fp.entries)
    # every FX-graph / AOTAutograd entry says it was built for this machine's system key
    assert fp.entry_system_keys == {torchinfo.system_key(): 3}
    assert fp.entry_torch_hashes == {stamps.current_torch_hash(): 3}


def test_real_cache_verifies_clean(cache_copy):
    r = verify_mod.verify(cache_copy)
    assert r.ok and r.findings == (), r.findings
    assert r.checked["fxgraph"] == 2 and r.deep


def test_real_cache_dangling_and_truncated_entries(cache_copy):
    shutil.rmtree(cache_copy / "fxgraph")
    r = verify_mod.verify(cache_copy)
    assert r.counts == {"dangling": 1}, r.findings
    so = next(cache_copy.rglob("*.so"))
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
    assert verify_mod.verify(cache_copy).counts == {"dangling": 1, "truncated": 1}


def test_saved_and_loaded_cache_hits_in_a_new_process(real_compile, cache_copy, tmp_path):
    res = archive_save.save(tmp_path / "warm.tar.gz", cache_copy)
    assert res.mega_cache == {"inductor": 2, "aot_autograd": 1}
    loaded = archive_load.load(tmp_path / "warm.tar.gz", tmp_path / "elsewhere")
    assert loaded.content_hash == fp_mod.fingerprint(cache_copy).content_hash
    counts = compile_into(tmp_path / "elsewhere", tmp_path, real_compile.tmp_root)
    assert counts["aot_autograd"].get("autograd_cache_hit") == 1, counts
    assert counts["inductor"].get("fxgraph_cache_miss", 0) == 0, counts


def test_mega_cache_preloads_into_this_process_cache_dir(cache_copy, tmp_path):
    archive_save.save(tmp_path / "warm.tar", cache_copy)
    target = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])  # the test's own tmp dir (conftest)
    counts = archive_load.load_mega_cache(tmp_path / "warm.tar")
    assert counts == {"inductor": 2, "aot_autograd": 1}
    assert len(list(target.glob("fxgraph/*/*/*"))) == 2 and len(list(target.glob("aotautograd/*/*"))) == 1


def test_every_pickle_of_a_real_cache_passes_the_scanner(real_cache):
    """The allow-list is derived from real caches (picklescan's docstring); a fresh one from this torch
    must pass whole, so a torch that starts pickling a new global fails here, not in a user's load."""
    from compilewatch.cache.trust import picklescan

    scanned = 0
    for f in layout.walk(real_cache).files:
        if layout.subcache_of(f.rel) in stamps.STAMPED_SUBCACHES:
            r = picklescan.scan((real_cache / f.rel).read_bytes())
            assert r.ok, (f.rel, r.refused, r.problem)
            scanned += 1
    assert scanned >= 3  # 2 FX graphs + 1 AOTAutograd entry


PGO_SCRIPT = '''
import torch


def f(x, y):
    return (x.sin() + y.cos()).relu().sum(dim=-1)


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("b", torch.ones(16))

    def forward(self, x):
        q = self.lin(x)[None]
        return torch.nn.functional.scaled_dot_product_attention(q, x[None], x[None]) + self.b


m = M()
for n in (8, 9, 10):  # a second size recompiles with dynamic shapes (sympy in the entries), PGO records it
    torch.compile(f)(torch.randn(n, 16, requires_grad=True), torch.randn(n, 16)).sum().backward()
    torch.compile(m)(torch.randn(n, 16)).sum().backward()
print("{}")
'''


@pytest.fixture(scope="session")
def real_pgo_cache(tmp_path_factory) -> Path:
    """A cache with every sub-cache this torch writes on CPU: dynamic shapes, a module with parameters
    and a buffer, SDPA, fwd+bwd, and PGO code-state files under dynamo/ (TORCH_COMPILE_JOB_ID set)."""
    base = tmp_path_factory.mktemp("real-pgo-cache")
    script = base / "compile_pgo.py"
    script.write_text(PGO_SCRIPT)
    env = compile_env()
    env.update(TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"), TORCHINDUCTOR_COMPILE_THREADS="1",
               TORCH_COMPILE_JOB_ID="compilewatch-test")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return base / "inductor"


def test_every_pickle_of_every_subcache_passes_the_scanner(real_pgo_cache):
    """Issue 29: the allow-list admits data constructors only, yet every pickle a real cache holds, in
    every sub-cache torch unpickles (fxgraph, aotautograd, dynamo/ PGO state), passes."""
    from compilewatch.cache.trust import picklescan

    per_sub: dict[str, int] = {}
    for f in layout.walk(real_pgo_cache).files:
        data = (real_pgo_cache / f.rel).read_bytes()
        if picklescan.is_pickle_file(f.rel, data[:1]):
            r = picklescan.scan(data)
            assert r.ok, (f.rel, r.refused, r.problem)
            with open(real_pgo_cache / f.rel, "rb") as fh, pytest.MonkeyPatch.context() as mp:
                mp.setattr(picklescan, "READ_WHOLE", 0)  # streamed, as a pickle over 64 MiB is
                assert picklescan.scan_file(fh, len(data)) == r, f.rel
            per_sub[f.rel.split("/")[0]] = per_sub.get(f.rel.split("/")[0], 0) + 1
    assert per_sub.get("fxgraph", 0) >= 4 and per_sub.get("aotautograd", 0) >= 2 and per_sub.get("dynamo", 0) >= 1, per_sub


def test_a_real_archive_is_made_here_and_its_mega_cache_preloads(real_pgo_cache, tmp_path):
    """save signs with this machine's key; verify says made here and scans every pickle and Mega-Cache
    artifact of a real cache (none refused); load_mega_cache checks provenance and scans, then preloads."""
    from compilewatch.cache.archive import check as archive_check

    archive_save.save(tmp_path / "pgo.tar", real_pgo_cache)
    rep = archive_check.verify_archive(tmp_path / "pgo.tar")
    assert rep.ok and rep.provenance.verdict == "own" and rep.findings == (), rep.findings
    assert rep.pickles_scanned >= 7 and rep.mega_artifacts_scanned >= 6
    # every cache member streamed from the archive and scanned as its opcodes ask (a member over 256 MiB)
    from compilewatch.cache.archive import reader as provenance
    from compilewatch.cache.trust import picklescan

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(provenance, "IN_MEMORY", 0)
        mp.setattr(picklescan, "READ_WHOLE", 0)
        assert archive_check.verify_archive(tmp_path / "pgo.tar") == rep
    counts = archive_load.load_mega_cache(tmp_path / "pgo.tar")
    assert counts and counts.get("inductor", 0) >= 4


def test_every_subcache_of_a_fresh_cache_is_named(real_compile, monkeypatch):
    """Every file torch wrote for one CPU inductor compile, in the cache dir and in torch's default dir
    (precompiled headers: 150 MB on 2.13, ~600 MB on 2.15), belongs to a named sub-cache, not "other";
    `locate` shows the header dir outside TORCHINDUCTOR_CACHE_DIR (not saved or cleared with it)."""
    from compilewatch import torchinfo

    named = {layout.subcache_of(f.rel) for f in layout.walk(real_compile.cache).files}
    assert "other" not in named and {"fxgraph", "aotautograd", "codegen"} <= named, named
    assert layout.unknown_entries(real_compile.cache) == ()
    default = {layout.subcache_of(f.rel) for f in layout.walk(real_compile.default_dir).files}
    assert "other" not in default, [f.rel for f in layout.walk(real_compile.default_dir).files
                                    if layout.subcache_of(f.rel) == "other"]
    assert "precompiled_headers" in default, default  # 2.11-2.15 all precompile cpp_prefix.h on CPU
    monkeypatch.setattr(torchinfo, "default_cache_dir", lambda: real_compile.default_dir)
    subs = {s.name: s for s in layout.locate(real_compile.cache).subcaches}
    ph = subs["precompiled_headers"]
    assert ph.exists and not ph.inside and ph.path == real_compile.default_dir / "precompiled_headers"
    assert subs["fxgraph"].inside and subs["fxgraph"].exists
