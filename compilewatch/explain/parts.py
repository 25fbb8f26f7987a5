"""The parts of a cache key, as torch prints them, turned into small named records.

torch computes an FX-graph cache key from `FxGraphHashDetails` (torch/_inductor/codecache.py, 2.11-2.15)
and describes it with `FxGraphCachePickler.debug_lines(details)`: one line per attribute (lists and
dicts one line per item), `"[<hash of the value>] <name>: <value>"`, e.g.

    [esstihe2...] inductor_config[max_autotune]: False
    [m5zxsmvq...] example_inputs[0]: TensorMetadata(dtype=torch.float32, shape=torch.Size([8, 8]), ...)

A part here is `name -> (digest, value)`: the first 16 characters of torch's hash (enough to tell two
values apart) and the value only when it is short and plain (a flag, a dtype/shape summary); long
values (graph code, torch's binary `torch_key`) keep their digest alone, and an explanation then says
"value not recorded" instead of guessing. Parts are split into groups stored once each (content
addressed): `config` (inductor config: ~600 lines that rarely change), `settings` (torch build,
system, determinism, environment), `kwargs` (compile_fx options) and `graph` (code and inputs).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

DIGEST_CHARS = 16
VALUE_CHARS = 96
GROUPS = ("graph", "kwargs", "settings", "config")

# environment variables that decide a compile but are not always visible in torch's own lines
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TORCH_LOGS", "PYTORCH_", "TRITON_")
# ... except those that name where the cache is (a moved cache dir is its own cause) or only log
ENV_IGNORED = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_LOGS", "TORCH_LOGS_OUT",
                         "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST",
                         "TORCHINDUCTOR_REDIS_PORT", "PYTORCH_CUDA_ALLOC_CONF"})
ENV_MARK = "env:recorded"  # present in every settings group compilewatch wrote: env parts can be compared

_LINE_RE = re.compile(r"^\[([0-9a-zA-Z]+)\] ([^:]+?): ?(.*)$", re.S)
_ADDR_RE = re.compile(r" at 0x[0-9a-f]+")
_SYM_RE = re.compile(r"^\('([a-z]\w*)',\)$")  # an input SymInt, as FxGraphCachePickler._reduce_symint prints it
_SYMBOLIC_RE = re.compile(r"^symbolic size |^\('[a-z]\w*',\)$|\[[^\]]*\b[a-z]+\d+")


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    digest: str
    value: str | None  # None: not recorded (too long or not plain text)


def group_of(name: str) -> str:
    attr = name.split("[", 1)[0]
    if attr.startswith("inductor_config"):
        return "config"
    if attr in ("gm", "example_inputs", "inputs_to_check", "user_defined_triton_source", "custom_ops"):
        return "graph"
    if attr == "fx_kwargs":
        return "kwargs"
    return "settings"


def _short_tensor(value: str) -> str:
    def field(name: str, pat: str) -> str | None:
        m = re.search(name + "=" + pat, value)
        return m.group(1) if m else None

    dtype = field("dtype", r"torch\.(\w+)")
    shape = field("shape", r"torch\.Size\((\[[^\]]*\])\)")
    stride = field("stride", r"(\([^)]*\))")
    dev = re.search(r"device=device\(type='(\w+)'(?:, index=(\d+))?\)", value)
    device = (dev.group(1) + (f":{dev.group(2)}" if dev.group(2) else "")) if dev else None
    grad = " requires_grad" if "requires_grad=True" in value else ""
    return f"{dtype} {shape} stride {stride} {device}{grad}"


def short_value(name: str, value: str) -> str | None:
    """The value worth keeping for `name`, or None (only its digest is kept)."""
    if name == "gm" or name == "torch_version":
        return None
    if value.startswith("TensorMetadata("):
        return _short_tensor(value)
    if name.startswith("example_inputs[") and (m := _SYM_RE.match(value)):  # torch hashes a SymInt by its name
        return f"symbolic size {m.group(1)}"
    value = _ADDR_RE.sub("", value)
    if len(value) > VALUE_CHARS or not value.isprintable():
        return None
    return value


def parse_lines(lines: list[str]) -> dict[str, dict[str, list]]:
    """torch's debug lines -> {group: {name: [digest, value]}} (lines that do not parse are skipped)."""
    out: dict[str, dict[str, list]] = {g: {} for g in GROUPS}
    for line in lines:
        m = _LINE_RE.match(line)
        if m is None:
            continue
        digest, name, value = m.group(1), m.group(2), m.group(3)
        out[group_of(name)][name] = [digest[:DIGEST_CHARS], short_value(name, value)]
    return out


def env_parts(environ) -> dict[str, list]:
    """The compile-relevant environment variables that are set, as parts of the settings group."""
    parts: dict[str, list] = {ENV_MARK: ["1", "1"]}
    for k, v in environ.items():
        if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED:
            parts[f"env[{k}]"] = [_digest(v), v if len(v) <= VALUE_CHARS and v.isprintable() else None]
    return parts


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest()


def group_id(parts: dict[str, list]) -> str:
    """Content address of one group: equal parts, equal id."""
    return _digest(json.dumps(parts, sort_keys=True, separators=(",", ":")))


# --- plain words and the order of causes --------------------------------------------------------

# (rank, prefix of a part name, words): the lowest rank is named first. Higher-level causes come first
# because they explain the lower ones (a new torch changes every part; a dtype can change the code).
_RANKS = (
    (0, "torch.__version__", "torch version"),
    (0, "torch_version", "torch build (version + source hash)"),
    (1, "system_info", "system"),
    (2, "cache dir", "cache dir"),
    (3, "env[", "environment"),
    (4, "cache_key_tag", "TORCH_COMPILE_CACHE_KEY_TAG"),
    (4, "deterministic_algorithms_settings", "torch.use_deterministic_algorithms (mode, warn_only, fill_uninitialized_memory):"),
    (4, "cuda_matmul_settings", "CUDA matmul settings (fp32 precision, tf32, reduced-precision reduction):"),
    (4, "default_dtype", "torch default dtype"),
    (4, "cpp_runtime_thread_count", "CPU thread count"),
    (5, "inductor_config_comms[", "inductor comms config"),
    (5, "inductor_config[", "inductor config"),
    (6, "fx_kwargs[", "compile option"),
    (7, "example_inputs[", "input"),
    (7, "inputs_to_check", "inputs to check"),
    (8, "user_defined_triton_source", "user triton kernel source"),
    (8, "gm", "graph code"),
)


def rank(name: str) -> int:
    for r, prefix, _ in _RANKS:
        if name.startswith(prefix):
            return r
    return 5  # a part this torch added that compilewatch does not know: between settings and inputs


def words(name: str) -> str:
    """A part's name in plain words: `inductor_config[max_autotune]` -> `inductor config max_autotune`."""
    for _, prefix, w in _RANKS:
        if name == prefix:
            return w
        if name.startswith(prefix) and prefix.endswith("["):
            inner = name[len(prefix):].rstrip("]")
            return f"{w} {inner}"
    if name.startswith(prefix_words := "system_info["):
        return f"system {name[len(prefix_words):].rstrip(']')}"
    return name.replace("_", " ")


def is_symbolic(value: str) -> bool:
    """An input's short value that holds a symbolic size (`symbolic size s77`, `float32 [s77, 8] ...`)."""
    return bool(_SYMBOLIC_RE.search(value))


def env_name(env_part: str) -> str:
    """`env[TORCHINDUCTOR_MAX_AUTOTUNE]` -> `TORCHINDUCTOR_MAX_AUTOTUNE`."""
    return env_part[len("env["):].rstrip("]")


def config_flag(part: str) -> str | None:
    """`inductor_config[triton.cudagraphs]` -> `triton.cudagraphs`; None for any other part."""
    return part[len("inductor_config["):].rstrip("]") if part.startswith("inductor_config[") else None


def env_sets(env_part: str, part: str) -> bool:
    """Whether the variable of `env[NAME]` is the one torch reads for `part` by name: TORCHINDUCTOR_SIZE_ASSERTS
    for inductor_config[size_asserts], TORCH_COMPILE_CACHE_KEY_TAG for cache_key_tag."""
    var = env_name(env_part)
    prefix = next((p for p in ENV_PREFIXES if var.startswith(p)), "")
    inner = part.split("[", 1)[1].rstrip("]") if part.startswith(("inductor_config", "fx_kwargs[")) else part
    return bool(inner) and var[len(prefix):].lower() == inner.lower()
