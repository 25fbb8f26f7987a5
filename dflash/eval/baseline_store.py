"""A run's plain baseline on disk (`RUN/eval_baseline.json`), so that a resumed run's first periodic
eval reuses it instead of decoding the prompts plainly again (at 8B, 4 prompts × 256 tokens, the plain
pass is ~5 s of a first eval's ~15 s: docs/benchmarks.md).

dflash.eval.reuse keeps the baseline in memory, proved to apply by the target's identity and its
parameters' version counters; neither survives the process. On disk it applies when everything that
decides the plain tokens and their time is the same as when it was measured (`identity`):
- the target: its directory, and each of its files' name, size and modification time (config, weights,
  tokenizer); its dtype, whether it runs in FP8 (target.fp8), how many of its norms run fused
  (dflash.model.fused_norm), its vocabulary (the mask token may grow it), the attention kernels the eval
  allows (dflash.eval.attention);
- where it ran: the device's name, torch's and transformers' versions;
- the decode: the prompts' token ids, the token budget, CUDA graphs on or off.
Anything else, or a file that does not parse or check, and the baseline is measured again (and the
file replaced), with a note that says why. The file is JSON (never a pickle), read up to MAX_BYTES;
every token must be an id of the target's vocabulary and every time finite and positive. It may have
come with a run directory from elsewhere: it is data, and the worst a forged one can do is misstate
the speedup that reuses it, which the note names as coming from this file.

Runs share baselines too (`eval.baseline_cache`): each measured one is also kept in a directory of the
machine (`shared_root`: $DFLASH_EVAL_CACHE, else ~/.cache/dflash/eval), named by a digest of everything
above (`shared_path`), so a new run of the same target, prompts and budget on the same machine takes it
at its first eval instead of decoding plainly (a first eval's plain pass is ~5 s at 8B). The same checks
apply to it; the run and step that measured it are named wherever it is used. The directory keeps the
SHARED_KEEP newest baselines (each is a few kB for 4 prompts; one decode to make again).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.eval.attention import NAME as ATTENTION
from dflash.eval.generation import Generation

FILE = "eval_baseline.json"
FORMAT = 1
MAX_BYTES = 16 << 20  # 64 prompts × 4,096 tokens of JSON ints is ~2 MB
SHARED_ENV = "DFLASH_EVAL_CACHE"
SHARED_KEEP = 64  # baselines the shared directory keeps (the newest written)
OFF = "off"
_SHARED_NAME = re.compile(r"[0-9a-f]{32}\.json")


def _device_name(device: torch.device) -> str:
    """The device's model (a CPU's with the threads torch uses: both decide a CPU decode's time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from compilewatch import cpu_info

        return f"cpu: {cpu_info().model}, {torch.get_num_threads()} threads"
    return device.type


def identity(target) -> dict[str, Any]:
    """What decides a plain greedy decode's tokens and time, besides the prompts and the budget."""
    import transformers

    from dflash.model.fp8 import Fp8Linear
    from dflash.model.fused_norm import FusedRMSNorm

    src = Path(str(target.source))
    files = []
    if src.is_dir():
        for f in sorted(src.iterdir()):
            if f.is_file():
                st = f.stat()
                files.append([f.name, st.st_size, st.st_mtime_ns])
    emb = target.model.get_input_embeddings()
    mods = list(target.model.modules())
    return {"source": str(target.source), "files": files, "dtype": str(target.dtype),
            "fp8": any(isinstance(m, Fp8Linear) for m in mods),
            "fused_norms": sum(isinstance(m, FusedRMSNorm) and m.fused for m in mods),  # dflash.model.fused_norm
            "vocab": int(emb.weight.shape[0]), "device": _device_name(target.device), "attention": ATTENTION,
            "torch": torch.__version__, "transformers": transformers.__version__}


def prompts_digest(prompts) -> str:
    return hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()


def shared_root(setting: str | None) -> Path | None:
    """The directory runs share baselines in, for the setting `eval.baseline_cache` (None: none)."""
    if setting == OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    env = os.environ.get(SHARED_ENV)
    if env:
        return None if env == OFF else Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash" / "eval"


def shared_path(root: Path, target, prompts, max_new_tokens: int, graphs: bool) -> Path:
    """Where in `root` the baseline of this decode is kept: a digest of what decides it."""
    key = json.dumps({"format": FORMAT, "identity": identity(target), "prompts": prompts_digest(prompts),
                      "max_new_tokens": max_new_tokens, "graphs": graphs}, sort_keys=True)
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def write(path: Path, base, target) -> None:
    """Keep `base` (a dflash.eval.reuse.PlainBaseline) at `path`, atomically, with the run that measured it."""
    from compilewatch import atomic_write_text

    rec = {"format": FORMAT, "identity": identity(target), "prompts": prompts_digest(base.prompts),
           "max_new_tokens": base.max_new_tokens, "graphs": base.graphs, "seconds": base.seconds,
           "setup_s": base.setup_s, "step": base.step, "run": base.run,
           "tokens": [list(g.tokens) for g in base.generations]}
    atomic_write_text(path, json.dumps(rec) + "\n")


def write_shared(root: Path, base, target) -> Path:
    """Keep `base` in the shared directory `root` (made private to this user when new), then drop the
    oldest baselines there beyond SHARED_KEEP (only files this module names: a digest and .json)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = shared_path(root, target, base.prompts, base.max_new_tokens, base.graphs)
    write(path, base, target)
    kept = []
    for f in root.iterdir():
        try:
            if _SHARED_NAME.fullmatch(f.name) and f.is_file() and not f.is_symlink():
                kept.append((f.stat().st_mtime_ns, f.name, f))
        except OSError:
            continue
    for _, _, f in sorted(kept, reverse=True)[SHARED_KEEP:]:
        f.unlink(missing_ok=True)
    return path


def _changed(key: str, then: Any, now: Any) -> str:
    if key == "files":
        was = {f[0]: f for f in then if isinstance(f, list) and f and isinstance(f[0], str)} \
            if isinstance(then, list) else {}
        is_ = {f[0]: f for f in now}
        names = sorted(n for n in was.keys() | is_.keys() if was.get(n) != is_.get(n))[:4]
        return "the target's files changed since" + (f" ({', '.join(names)})" if names else "")
    return f"{key} was {str(then)[:80]!r} then, is {str(now)[:80]!r} now"


def _why_not(rec: Any, target, prompts, max_new_tokens: int, graphs: bool) -> str | None:
    """Why the record `rec` (parsed JSON) does not apply to this decode (None: it does)."""
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        return "not a baseline of this dflash's format"
    now = identity(target)
    then = rec.get("identity")
    if not isinstance(then, dict):
        return "it names no target"
    changed = [k for k in now if then.get(k) != now[k]]
    if changed:
        return "; ".join(_changed(k, then.get(k), now[k]) for k in changed)
    if rec.get("prompts") != prompts_digest(prompts) or rec.get("max_new_tokens") != max_new_tokens:
        return "other prompts or another token budget"
    if rec.get("graphs") is not graphs:
        return "CUDA graphs were " + ("on" if rec.get("graphs") else "off") + " then"
    tokens, vocab = rec.get("tokens"), now["vocab"]
    if (not isinstance(tokens, list) or len(tokens) != len(prompts)
            or not all(isinstance(t, list) and len(t) <= max_new_tokens for t in tokens)
            or not all(type(x) is int and 0 <= x < vocab for t in tokens for x in t)):
        return "its tokens do not check (not one list of token ids per prompt, within the budget and the vocabulary)"
    times = (rec.get("seconds"), rec.get("setup_s"))
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in times) \
            or not times[0] > 0 or not times[1] >= 0:
        return "its times do not check"
    step = rec.get("step")
    if step is not None and (type(step) is not int or step < 0):
        return "its step does not check"
    run = rec.get("run")
    if run is not None and not (isinstance(run, str) and 0 < len(run) <= 4096):
        return "its run does not check"
    return None


@dataclass(frozen=True)
class Stored:
    """A kept baseline that applies to the decode it was read for (dflash.eval.reuse makes it a PlainBaseline)."""

    generations: tuple[Generation, ...]
    seconds: float
    setup_s: float
    step: int | None
    path: str
    run: str | None = None  # the run directory whose eval measured it (None: not recorded)


def read(path: Path, target, prompts, max_new_tokens: int, graphs: bool) -> tuple[Stored | None, str | None]:
    """(the kept baseline where it applies to this decode of `prompts` by `target`, or None; a note
    saying why it was not used, None when there was no file)."""
    import stat

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open, a device never end
            return None, f"{path} is not a regular file: not read; the plain baseline is measured again"
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path} not read ({type(e).__name__}: {e}): the plain baseline is measured again"
    if len(raw) > MAX_BYTES:
        return None, f"{path} is over {MAX_BYTES >> 20} MiB: not read; the plain baseline is measured again"
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, f"{path} is not JSON: the plain baseline is measured again"
    why = _why_not(rec, target, prompts, max_new_tokens, graphs)
    if why is not None:
        return None, f"{path} does not apply ({why}): the plain baseline is measured again"
    gens = tuple(Generation(tokens=list(t), acceptance=[], seconds=float(rec["seconds"])) for t in rec["tokens"])
    return Stored(gens, float(rec["seconds"]), float(rec["setup_s"]), rec["step"], str(path), rec.get("run")), None
