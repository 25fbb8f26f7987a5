"""The 8B first step from torch's Redis remote cache seeded by a previous run, vs cold.

Runs the real `dflash train` CLI (the `qwen3_8b` recipe on a random Qwen3-8B-shaped target, as
benchmarks/dflash_startup.py builds it; no download) under `compilewatch run`, whose summary carries
torch's own remote-cache counters per kind, one process after another:

  1. cold:   an empty TORCHINDUCTOR_CACHE_DIR, no remote cache (the baseline)
  2. seed:   an empty local cache, `--set cache.remote=URL` on an empty Redis (fills it)
  3. remote: another empty local cache, the same Redis (what a new or replaced node sees)

Each with `--max-steps 1`; results per run: wall time, the first step's metrics row, remote hits /
misses / puts per kind, and `cache remote status` after the run. Results: <out>/gpu_remote_cache.json.

The Redis server: --url names a running one; else a `redis-server` binary (PATH or --redis-server) is
started on a free loopback port; else --redis-debs DIR extracts Debian's packages found there
(redis-server, redis-tools, libjemalloc2, liblzf1: `apt-get download redis-server redis-tools
libjemalloc2 liblzf1` on a Debian 12 machine) with Python's own ar/tar readers, no root, no dpkg.

GPU (H200):       python benchmarks/gpu_remote_cache.py --out $OUT --redis-debs debs/
CPU smoke (tiny): python benchmarks/gpu_remote_cache.py --small --out /tmp/gpu-remote
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REMOTE_ENV = ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE", "TORCHINDUCTOR_REDIS_URL",
              "TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"cw_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def extract_debs(debs: Path, dest: Path) -> Path:
    """Unpack every *.deb in `debs` into `dest` (ar archive -> data.tar.*); returns dest."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob("*.deb"))
    if not found:
        raise SystemExit(f"no .deb files in {debs}")
    for deb in found:
        raw = deb.read_bytes()
        if raw[:8] != b"!<arch>\n":
            raise SystemExit(f"{deb} is not a Debian package")
        pos = 8
        while pos + 60 <= len(raw):
            name = raw[pos:pos + 16].decode().strip().rstrip("/")
            size = int(raw[pos + 48:pos + 58].decode().strip())
            body = raw[pos + 60:pos + 60 + size]
            pos += 60 + size + (size & 1)
            if name.startswith("data.tar"):
                with tarfile.open(fileobj=io.BytesIO(body)) as t:
                    t.extractall(dest, filter="tar") if hasattr(tarfile, "data_filter") else t.extractall(dest)
    return dest


def redis_binary(a: argparse.Namespace, work: Path) -> tuple[str, dict]:
    if a.redis_server or shutil.which("redis-server"):
        return a.redis_server or shutil.which("redis-server"), dict(os.environ)
    if a.redis_debs:
        root = extract_debs(Path(a.redis_debs), work / "redis-root")
        binary = root / "usr" / "bin" / "redis-server"
        libs = [str(p) for p in (root / "usr" / "lib").glob("*-linux-gnu")] + [str(root / "usr" / "lib")]
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])}
        return str(binary), env
    raise SystemExit("no redis-server: pass --url, --redis-server, or --redis-debs DIR with Debian's redis-server, "
                     "redis-tools, libjemalloc2 and liblzf1 packages (apt-get download redis-server redis-tools "
                     "libjemalloc2 liblzf1)")


def watched_train(name: str, args: list[str], env: dict, work: Path, timeout: float) -> dict:
    """`compilewatch run --json -- dflash train ARGS`: wall time and the watcher's summary."""
    report = work / f"{name}.json"
    code = "import sys; from cli.dflash_main import main; sys.exit(main())"
    cmd = [sys.executable, "-m", "cli.main", "run", "--json", "--", sys.executable, "-c", code, "train", *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    (work / f"{name}.log").write_text(p.stderr)
    try:
        summary = json.loads(p.stdout)["summary"]
    except (ValueError, KeyError):
        summary = None
    report.write_text(p.stdout)
    return {"name": name, "rc": p.returncode, "wall_s": round(wall, 2),
            "remote_cache": summary and summary.get("remote_cache"), "verdicts": summary and summary.get("verdicts"),
            "stderr_tail": p.stderr[-2000:]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/gpu-remote-cache", help="target, data, caches, runs, the Redis dir")
    p.add_argument("--small", action="store_true", help="tiny target on CPU (smoke test)")
    p.add_argument("--url", help="a running Redis to use (flushed before the seed run!)")
    p.add_argument("--redis-server", help="a redis-server binary")
    p.add_argument("--redis-debs", help="a dir with Debian's redis .deb files (see the module docstring)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--skip", default="", help="comma list of runs to skip: cold,seed,remote")
    a = p.parse_args(argv)
    startup = _load("dflash_startup")
    bench = _load("remote_cache_cpu")
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    target, data = work / "target", work / "chats.jsonl"
    result: dict = {"machine": os.uname().nodename, "argv": sys.argv, "runs": []}
    result["target_build_s"] = round(startup.make_target(target, a.small), 2)
    startup.make_data(data, 64, 300 if a.small else 3000)
    proc = None
    try:
        url = a.url
        if url is None:
            binary, renv = redis_binary(a, work)
            proc, url = bench.start_redis(binary, work / "redis", renv)
        import redis

        redis.Redis.from_url(url).flushdb()
        base = ["--recipe", "qwen3_8b", "--target", str(target), "--data", str(data), "--max-steps", "1"]
        if a.small:
            base = ["--target", str(target), "--data", str(data), "--max-steps", "1", "--set", "data.max_length=512",
                    "--set", "data.buckets=[256,512]"]
        env0 = {k: v for k, v in os.environ.items() if k not in REMOTE_ENV}
        env0.update(PYTHONUNBUFFERED="1", COLUMNS="200",
                    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        skip = set(a.skip.split(","))
        for name in ("cold", "seed", "remote"):
            if name in skip:
                continue
            env = {**env0, "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{name}")}
            extra = [] if name == "cold" else ["--set", f"cache.remote={url}"]
            r = watched_train(name, [*base, "--out", str(work / f"run-{name}"), *extra], env, work, a.timeout)
            r["metrics"] = [m for m in startup.rows_of(work / f"run-{name}") if m.get("step")][:2]
            st = subprocess.run([sys.executable, "-m", "cli.main", "cache", "remote", "status", url, "--json"],
                                cwd=str(ROOT), env=env0, capture_output=True, text=True, timeout=300)
            try:
                s = json.loads(st.stdout)
                r["remote_after"] = {"torch_keys": s["torch_keys"], "bytes": s["bytes"],
                                     "kinds": s["kinds"], "would_hit": s["would_hit"]}
            except (ValueError, KeyError):
                r["remote_after"] = None
            result["runs"].append(r)
            print(name, r["rc"], r["wall_s"], "s", json.dumps(r["remote_cache"]))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    (out / "gpu_remote_cache.json").write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
