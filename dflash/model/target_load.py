"""The target loaded in threads, beside a start's other work (issue 39): load_target's stages
(dflash.model.target) run as soon as what each needs is there, and the caller takes each result when
it needs it.

    load = TargetLoad(cfg.target, cfg.drafter.num_layers, device, wait=imports.wait)   # starts now
    shape = load.shape()       # tokenizer, config, taps, mask token: the data and the drafter can start
    target = load.result()     # the frozen Target (the same one load_target gives)

Two threads: "weights" reads the safetensors files straight onto the device (it needs only torch and
safetensors, so it starts at once, beside transformers' import), and "target" waits for the tokenizer
stack (`wait("tokenizer")`: dflash.training.preload, which owns transformers' imports), loads the
tokenizer and config (the shape), then waits for the model stack and the weights and builds the model
around them. Each result raises, in the thread that asks for it, the very exception its stage raised.
`TargetLoad.of(load)` wraps a loader that returns a Target whole (a test's or a benchmark's stand-in
for load_target): its shape is that Target's, known when it is done.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dflash.config import TargetConfig
from dflash.model.target import (
    Target, TargetShape, check_fp8, finish_target, load_model, read_target_weights, resolve_dtype, target_shape, weight_files,
)

Wait = Callable[[str], None]  # blocks until an import stage ("tokenizer", "model") is done, or raises its error


class Stage:
    """One stage in its own thread: its result or exception, and its perf_counter (start, end)."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.name = name
        self.span = (time.perf_counter(), 0.0)
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"dflash-start-{name}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 - raised by result() in the thread that asks
            self._error = e
        finally:
            self.span = (self.span[0], time.perf_counter())

    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def join(self) -> None:
        """Wait for the thread, raising nothing (a start that failed elsewhere)."""
        self._thread.join()


class TargetLoad:
    """See the module doc. `stages`: the threads, by name ("weights" only for a directory target read
    straight onto its device)."""

    def __init__(self, cfg: TargetConfig, num_draft_layers: int, device: torch.device | str,
                 dtype_spec: str | None = None, *, wait: Wait | None = None) -> None:
        self.cfg, self.num_draft_layers = cfg, num_draft_layers
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype_spec or cfg.dtype, self.device)
        check_fp8(cfg, self.device, self.dtype)
        self._wait = wait or (lambda stage: None)
        self._shape: TargetShape | None = None
        self._shape_ready = threading.Event()
        self._shape_error: BaseException | None = None
        self._stop = threading.Event()  # set when the load failed: the weights read stops at its next tensor
        self.stages: dict[str, Stage] = {}
        files = weight_files(cfg)
        if files is not None:
            path = Path(cfg.path).expanduser()
            self.stages["weights"] = Stage("weights", lambda: read_target_weights(path, files, self.device, self._stop))
        self.stages["target"] = Stage("target", self._load)

    @classmethod
    def of(cls, load: Callable[[], Target]) -> "TargetLoad":
        """A loader run whole in a thread; its shape is known once its Target is."""
        self = cls.__new__(cls)
        self._shape, self._shape_error = None, None
        self._shape_ready, self._stop = threading.Event(), threading.Event()

        def whole() -> Target:
            try:
                target = load()
            except BaseException as e:
                self._shape_error = e
                raise
            finally:
                self._shape_ready.set()
            return target

        self.stages = {"target": Stage("target", whole)}
        return self

    def _load(self) -> Target:
        try:
            try:
                self._wait("tokenizer")
                self._shape = target_shape(self.cfg, self.num_draft_layers)
            except BaseException as e:
                self._shape_error = e
                raise
            finally:
                self._shape_ready.set()
            self._wait("model")
            weights = self.stages["weights"].result() if "weights" in self.stages else None
            model = load_model(self.cfg, self._shape.config, self.dtype, self.device, weights)
            return finish_target(self.cfg, self._shape, model, self.device, self.dtype)
        except BaseException:
            self._stop.set()
            raise

    def reading(self) -> bool:
        """Whether the weights are still being read straight onto the device (False without that stage)."""
        return "weights" in self.stages and self.stages["weights"].running()

    def shape(self) -> TargetShape | Target:
        """What the drafter and the data need (a TargetShape; a wrapped loader's Target itself),
        once known; raises the shape stage's error."""
        self._shape_ready.wait()
        if self._shape_error is not None:
            raise self._shape_error
        return self._shape if self._shape is not None else self.stages["target"].result()

    def result(self) -> Target:
        """The loaded Target; raises the error of whichever stage failed."""
        return self.stages["target"].result()

    def stop(self) -> None:
        """Wait for every thread, raising nothing, the weights read cut short (the start failed
        elsewhere: nothing keeps loading after it returns)."""
        self._stop.set()
        for s in self.stages.values():
            s.join()
