"""Two torchrun ranks (gloo, CPU), separate empty local caches, one Redis: what the remote cache saves.

Jobs (each `torchrun --nproc-per-node 2 benchmarks/remote_cache_job.py`, every rank with its own
empty TORCHINDUCTOR_CACHE_DIR):

  1. local:   remote caches off (the cold baseline)
  2. seed:    remote FX-graph + AOTAutograd caches on, an empty Redis (the first job of a cluster)
  3. remote:  remote on, new empty local caches, the Redis job 2 filled

Per job and rank: first and second step time, torch's FX-graph / AOTAutograd hits and misses and its
remote-cache counters. Starts its own `redis-server` (found on PATH, or --redis-server) on a free
loopback port unless --url names one. Results: <out>/remote_cache_cpu.json.

  python benchmarks/remote_cache_cpu.py --out /tmp/remote-bench            # dim 256
  python benchmarks/remote_cache_cpu.py --out /tmp/remote-bench --dim 64 --jobs seed,remote
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "remote_cache_job.py"
REMOTE_ENV = ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE", "TORCHINDUCTOR_REDIS_URL",
              "TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(binary: str, workdir: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A redis-server on a free loopback port, persistence off; returns (process, url) once it answers."""
    import redis

    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    while True:  # a benchmark may poll; tests wait for the server's own ready line (tests/redis_helpers.py)
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
            return proc, url
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{binary} did not start (exit {proc.poll()})") from None
            time.sleep(0.05)


def run_job(out: Path, cache_base: Path, url: str | None, *, dim: int = 256, nproc: int = 2,
            timeout: float = 600) -> list[dict]:
    """One torchrun job; each rank's JSON (rank order). `url=None`: remote caches off."""
    env = {k: v for k, v in os.environ.items() if k not in REMOTE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    if url is not None:
        env.update(TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1", TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
                   TORCHINDUCTOR_REDIS_URL=url)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(JOB), str(out), str(cache_base), str(dim)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    if p.returncode != 0:
        raise RuntimeError(f"torchrun failed ({p.returncode}): {p.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]
    for r in ranks:
        r["job_wall_s"] = time.perf_counter() - t0
    return ranks


def summary(ranks: list[dict]) -> dict:
    def total(group: str, key: str) -> int:
        return sum(int(r[group].get(key, 0)) for r in ranks)

    remote_fx = [r["remote"].get("RemoteFxGraphCache", {}) for r in ranks if r.get("remote")]
    return {"first_step_s": [round(r["first_step_s"], 3) for r in ranks],
            "second_step_s": [round(r["second_step_s"], 4) for r in ranks],
            "fxgraph_hit": total("inductor", "fxgraph_cache_hit"), "fxgraph_miss": total("inductor", "fxgraph_cache_miss"),
            "autograd_hit": total("aot_autograd", "autograd_cache_hit"),
            "autograd_miss": total("aot_autograd", "autograd_cache_miss"),
            "remote_fx_hit": sum(x.get("hit", 0) for x in remote_fx), "remote_fx_miss": sum(x.get("miss", 0) for x in remote_fx),
            "job_wall_s": round(ranks[0]["job_wall_s"], 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--jobs", default="local,seed,remote")
    p.add_argument("--url", help="use this Redis (it is flushed before the seed job!) instead of starting one")
    p.add_argument("--redis-server", default=shutil.which("redis-server"), help="the redis-server binary")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    proc = None
    try:
        url = a.url
        if url is None:
            if not a.redis_server:
                raise SystemExit("no redis-server on PATH: apt-get install -y redis-server, or pass --url / --redis-server")
            proc, url = start_redis(a.redis_server, work / "redis")
        import redis

        result: dict = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "dim": a.dim, "argv": sys.argv,
                        "torch": __import__("torch").__version__, "jobs": {}}
        for job in a.jobs.split(","):
            if job == "seed":
                redis.Redis.from_url(url).flushdb()
            ranks = run_job(work / f"out-{job}", work / f"cache-{job}", None if job == "local" else url, dim=a.dim)
            result["jobs"][job] = {"summary": summary(ranks), "ranks": ranks}
            print(job, json.dumps(result["jobs"][job]["summary"]))
        (out / "remote_cache_cpu.json").write_text(json.dumps(result, indent=1))
        return result
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
