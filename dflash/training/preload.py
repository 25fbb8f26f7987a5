"""The start's heavy imports, begun at once in one thread (issue 39): torch, then transformers'
tokenizer and config stack, then its model stack (modeling_utils, generation, the target's own
modeling module) and safetensors, while the thread that started them checks input, initializes
CUDA and reads files (weights, the data cache, the resume checkpoint).

    imports = start_imports(cfg.target)   # returns at once; one per process (later calls get it back)
    imports.wait("tokenizer")             # AutoTokenizer / AutoConfig are imported (or their error raised)
    imports.wait("model")                 # the model stack too

Stages, in order: "torch", "tokenizer", "model". `wait(stage)` raises the very exception the import
raised (its type, message and traceback: what the sequential start gives) when that stage or one
before it failed; a later stage's failure is not raised to a caller that needs less. Never started
(a library caller that built a Trainer directly): `wait` imports inline, in the calling thread.

One thread owns these imports: code that touches transformers waits for the stage it needs first, and
the thread that started them waits for the "torch" stage (torch, dynamo, triton, and its own next
modules: `first`) before it goes on, so two threads never import one library's modules at once
(torch's and transformers' modules import each other in cycles; two threads entering one from both
ends is an import deadlock: tests/test_fast_start.py checks what the start's other threads still
import). The thread is a daemon: bad input found while it runs exits at once (exit 2), without
waiting for transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import threading
import time
from pathlib import Path
from typing import Any

STAGES = ("torch", "tokenizer", "model")
# torch's heavy lazy imports (dynamo pulls fx, sympy, functorch, the decompositions; triton where there
# is one): the caller's thread meets them anyway (meta-device builds, compiles), so they are imported
# here, before it goes on; and safetensors, which the weights' reader imports before transformers is in
_TORCH_STACK = ("torch", "torch._dynamo", "triton", "safetensors")
_TOKENIZER_STACK = ("transformers", "transformers.models.auto.tokenization_auto",
                    "transformers.models.auto.configuration_auto", "transformers.tokenization_utils_tokenizers",
                    "tokenizers")
_MODEL_STACK = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto", "safetensors.torch")
_EMBEDDED_MODEL_TYPE = "qwen3"  # embedded:tiny is a Qwen3


def model_type_of(target: Any) -> str | None:
    """The target's `model_type` (config.json, read as JSON: no transformers), to import its modeling
    module early; None when it cannot be told cheaply (the loader imports it later, as before)."""
    path = str(getattr(target, "path", "") or "")
    if path.startswith("embedded:"):
        return _EMBEDDED_MODEL_TYPE
    try:
        with open(Path(path).expanduser() / "config.json", "rb") as fh:
            raw = fh.read(1 << 20)
        model_type = json.loads(raw).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) and model_type.isidentifier() else None


def _present(names: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                out.append(name)
        except (ImportError, ValueError):
            pass
    return tuple(out)


def _modeling_module(model_type: str | None) -> str | None:
    if model_type is None:
        return None
    name = f"transformers.models.{model_type}.modeling_{model_type}"
    try:
        return name if importlib.util.find_spec(name) is not None else None
    except (ImportError, ValueError):
        return None


class Imports:
    """The staged imports of one process (see the module doc). `span`: perf_counter (start, end) of the
    thread; `at`: seconds since process start when it ended; `seconds`: each stage's own time."""

    def __init__(self, model_type: str | None = None, first: tuple[str, ...] = ()) -> None:
        self.model_type = model_type
        self.first = first  # imported with torch, before the caller's thread goes on (see start_imports)
        self.seconds: dict[str, float] = {}
        self.span = (time.perf_counter(), 0.0)
        self.at = 0.0
        self.thread: threading.Thread | None = None
        self._done = {s: threading.Event() for s in STAGES}
        self._errors: dict[str, BaseException] = {}
        self._inline = threading.Lock()
        self.reported = False  # its phase was reported (once per process: dflash.training.build)

    def start(self) -> "Imports":
        self.span = (time.perf_counter(), 0.0)
        self.thread = threading.Thread(target=self._run, name="dflash-start-imports", daemon=True)
        self.thread.start()
        return self

    def _modules(self, stage: str) -> tuple[str, ...]:
        """The stage's modules (run in the thread: finding a submodule imports its parents). torch,
        transformers and `first` are required (their ImportError is the start's); the rest only where
        this install has them (module names move between transformers releases)."""
        if stage == "torch":
            return ("torch", *_present(_TORCH_STACK[1:]), *self.first)
        if stage == "tokenizer":
            return ("transformers", *_present(_TOKENIZER_STACK[1:]))
        own = _modeling_module(self.model_type)
        return _present(_MODEL_STACK + ((own,) if own else ()))

    def _run(self, upto: str = STAGES[-1]) -> None:
        from dflash.training.startup import seconds_since_process_start

        for stage in STAGES[: STAGES.index(upto) + 1]:
            if self._done[stage].is_set():
                continue
            t0 = time.perf_counter()
            try:
                for name in self._modules(stage):
                    importlib.import_module(name)
            except BaseException as e:  # noqa: BLE001 - raised by wait() in the thread that needs the stage
                for later in STAGES[STAGES.index(stage):]:
                    self._errors[later] = e
                    self._done[later].set()
                break
            finally:
                self.seconds[stage] = round(time.perf_counter() - t0, 3)
            if stage == STAGES[-1]:  # the span is final before anyone sees the last stage done
                self.span = (self.span[0], time.perf_counter())
                self.at = seconds_since_process_start()
            self._done[stage].set()

    def wait(self, stage: str) -> None:
        """Block until `stage` is imported; raise its import error (or an earlier stage's)."""
        if stage not in STAGES:
            raise ValueError(f"unknown import stage {stage!r} (one of {', '.join(STAGES)})")
        if self.thread is None:  # never started: the sequential start
            with self._inline:
                self._run(stage)
        self._done[stage].wait()
        error = self._errors.get(stage)
        if error is not None:
            raise error

    @property
    def done(self) -> bool:
        return self._done[STAGES[-1]].is_set()


_LOCK = threading.Lock()
_IMPORTS: Imports | None = None


def start_imports(target: Any = None, first: tuple[str, ...] = ()) -> Imports:
    """This process's imports, started now in a thread unless they already were (`target`: the
    TargetConfig, whose modeling module is imported with the model stack; `first`: modules imported
    with torch, in the "torch" stage: what the caller's thread imports next, which then waits for
    that stage rather than import torch's modules beside this thread)."""
    global _IMPORTS
    with _LOCK:
        if _IMPORTS is None:
            _IMPORTS = Imports(model_type_of(target) if target is not None else None, first).start()
        return _IMPORTS


def imports() -> Imports:
    """The process's imports: the started ones, or (never started) ones that run inline on `wait`."""
    global _IMPORTS
    with _LOCK:
        if _IMPORTS is None:
            _IMPORTS = Imports()
        return _IMPORTS
