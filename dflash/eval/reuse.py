"""What a run's evals keep from one to the next (`EvalState`), so that a periodic eval pays for
decoding, not for setting decoding up (issue 39: at 8B, 4 prompts × 256 tokens, ~3 s of a 12 s eval
was CUDA-graph capture and warm-up, paid again at every eval, and half of the rest a plain decode
whose tokens and time never change while only the drafter trains).

- **The speculative steps.** One `SpecWorkspace` (dflash.eval.batched) for the eval's shape: the
  target's and the drafter's slots (kept per batch size: `keep_sizes`, dflash.eval.slots) and the
  verify and draft steps with their CUDA graphs. A graph reads its inputs, slots and weights by
  address: the next eval's inputs are copied into its static buffers, and the drafter's weights,
  updated in place by the optimizer (or copied in place into the eval's own copy of the drafter,
  dflash.eval.in_training), are what its replays read. Each kept graph is checked against an eager
  run at its first replay of every eval (dflash.eval.graphs); one that disagrees is captured again.
  A decode of another shape (more prompts at the end of the run) gets a workspace of its own, not kept.
- **The plain baseline.** The target's greedy decode of the same prompts with the same budget gives
  the same tokens as long as the target is the same, unchanged object: `PlainBaseline.applies`
  checks the prompts, the budget, the graph mode, the target's identity and, per parameter, its
  address and version counter (any in-place write bumps it). Its time is reused less its graph
  setup, and the speedup takes the speculative pass's own setup off too (the replay checks of a later
  eval, the captures of a new process's first eval): it compares decoding with decoding.
- **The warm-up** (one short decode each way, dflash.eval.batched.evaluate_batched) runs at the
  first eval only; the plain one not at all when that eval takes a kept baseline (nothing plain is timed).
- `EvalState.last` (an `EvalCost`): what the latest eval captured, reused and measured; the
  trainer's periodic_eval event carries it.

The memory it holds between evals: the slots (at 8B, ~90 MB per prompt for 256 new tokens, twice
that over the batch sizes a shrinking batch passes through) and the graphs' pools.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash.eval.batched import BatchDecode, SpecWorkspace, spec_length
from dflash.eval.generation import Generation


@dataclass(frozen=True)
class EvalCost:
    """What one eval paid for and what it took from an earlier eval of the same EvalState."""

    graphs_captured: int  # CUDA graphs captured by this eval (plain and speculative steps)
    graphs_reused: int  # graphs an earlier eval captured, replayed here (each checked against eager once)
    graph_setup_s: float  # warm-ups, captures and replay checks of this eval's graphs
    plain_baseline: str  # "measured", or whose plain decode this eval reused: "step N" / "an earlier eval"
    #                      (", from eval_baseline.json" when an earlier process measured it)
    warmed_up: bool  # the warm-up decodes ran (an EvalState's first eval)
    # where the eval's seconds went, in order: "warm_up", "plain" (0 when reused), "speculative" (or
    # "reference": the batch-1 loop, both passes), then "weigh" (the near-tie forwards,
    # dflash.eval.divergence) once the caller adds it (`with_part`)
    parts_s: tuple[tuple[str, float], ...] = ()

    def with_part(self, name: str, seconds: float) -> EvalCost:
        return replace(self, parts_s=(*self.parts_s, (name, seconds)))

    def event(self) -> dict[str, Any]:
        """The fields as a metrics event carries them."""
        return {"graphs_captured": self.graphs_captured, "graphs_reused": self.graphs_reused,
                "graph_setup_s": round(self.graph_setup_s, 3), "plain_baseline": self.plain_baseline,
                "warmed_up": self.warmed_up, "parts_s": {k: round(v, 3) for k, v in self.parts_s}}


def _version(p) -> int:
    try:
        return p._version
    except RuntimeError:  # an inference tensor has no counter (and cannot be written outside inference mode)
        return -1


def target_stamp(target) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The target's identity and, per parameter, (address, version counter): equal stamps mean no
    parameter was replaced or written in place in between."""
    return id(target), tuple((p.data_ptr(), _version(p)) for p in target.model.parameters())


@dataclass(frozen=True)
class PlainBaseline:
    """A plain batched decode kept for later evals of the same prompts (module docstring)."""

    target: Any
    stamp: tuple
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    graphs: bool
    generations: tuple[Generation, ...]
    seconds: float  # the decode's wall time less its graph setup
    setup_s: float  # the graph setup it paid then
    step: int | None  # the training step of the eval that measured it (None: not a training eval)
    stored: str | None = None  # read from this file (dflash.eval.baseline_store): an earlier process measured it
    run: str | None = None  # the run directory whose eval measured it (None: not a run's, or not recorded)
    foreign: bool = False  # another run measured it (read from the machine's shared baselines)

    def applies(self, target, prompts: list[list[int]], max_new_tokens: int, graphs: bool) -> bool:
        """Whether a plain decode of `prompts` by `target` now would give these tokens."""
        return (target is self.target and max_new_tokens == self.max_new_tokens and graphs == self.graphs
                and tuple(map(tuple, prompts)) == self.prompts and target_stamp(target) == self.stamp)

    def _by(self) -> str:
        step = f"step {self.step}" if self.step is not None else "an earlier eval"
        return f"{step} of run {Path(self.run).name}" if self.foreign and self.run else step

    def source(self) -> str:
        return f"{self._by()}, from {Path(self.stored).name}" if self.stored else self._by()

    def note(self) -> str:
        who = (f"run {self.run} measured it: the same target files, device, versions, prompts and budget"
               if self.foreign and self.run else "an earlier process of this run measured it")
        where = f", read from {self.stored} ({who})" if self.stored else ""
        return (f"plain baseline from {self._by()}'s eval (the target is frozen): its tokens and its time "
                f"({self.seconds:.2f} s, its {self.setup_s:.2f} s of graph setup taken off), reused by every later "
                f"eval of the same {len(self.prompts)} prompts{where}")


class EvalState:
    """What a run's evals keep (module docstring): made empty, filled by the first eval
    (dflash.eval.batched.evaluate_batched with `state=`), used by the later ones."""

    def __init__(self, store: Path | None = None, shared: Path | None = None, run: str | None = None) -> None:
        """`store`: where the baseline is kept between processes (a run's RUN/eval_baseline.json,
        dflash.eval.baseline_store): read at the first eval that finds none in memory, written when
        one is measured. `shared`: the machine's directory of baselines kept for other runs
        (baseline_store.shared_root), read when `store` has none that applies and written with it;
        `run`: this run's directory (named in what it writes there)."""
        self.store, self.shared, self.run = store, shared, run
        self.store_note: str | None = None  # why the stored baseline was not used (None: used, or no file)
        self._store_read = False
        self.workspace: SpecWorkspace | None = None
        self.baseline: PlainBaseline | None = None
        self.drafter_copy: Any = None  # dflash.eval.in_training: the drafter beside a target on another device
        self.evals = 0
        self.last: EvalCost | None = None

    def workspace_for(self, drafter, target, prompts: list[list[int]], max_new_tokens: int, block_size: int,
                      graphs: bool) -> SpecWorkspace:
        """The kept workspace when it fits this decode; else a new one, kept when none is yet (the
        first eval's shape is the periodic evals' own)."""
        rows, length = len(prompts), spec_length(prompts, max_new_tokens, block_size)
        ws = self.workspace
        if ws is not None and ws.fits(drafter, target, rows, length, block_size, graphs):
            return ws
        ws = SpecWorkspace(drafter, target, rows, length, block_size, graphs, keep=self.workspace is None)
        if self.workspace is None:
            self.workspace = ws
        return ws

    def baseline_for(self, target, prompts: list[list[int]], max_new_tokens: int, graphs: bool) -> PlainBaseline | None:
        if self.baseline is None and (self.store or self.shared) is not None and not self._store_read:
            self._store_read = True
            self.baseline = self._read_stored(target, prompts, max_new_tokens, graphs)
        base = self.baseline
        return base if base is not None and base.applies(target, prompts, max_new_tokens, graphs) else None

    def _read_stored(self, target, prompts, max_new_tokens: int, graphs: bool) -> PlainBaseline | None:
        """The run's own stored baseline where it applies, else the shared directory's (then also kept
        in the run's file, for its resumes); the notes of what did not apply in `store_note`."""
        from dflash.eval import baseline_store

        notes, kept, shared = [], None, False
        if self.store is not None:
            kept, note = baseline_store.read(self.store, target, prompts, max_new_tokens, graphs)
            notes += [note] if note else []
        if kept is None and self.shared is not None:
            path = baseline_store.shared_path(self.shared, target, prompts, max_new_tokens, graphs)
            kept, note = baseline_store.read(path, target, prompts, max_new_tokens, graphs)
            notes += [note] if note else []
            shared = kept is not None
        self.store_note = "; ".join(notes) or None
        if kept is None:
            return None
        base = PlainBaseline(target, target_stamp(target), tuple(map(tuple, prompts)), max_new_tokens, graphs,
                             kept.generations, kept.seconds, kept.setup_s, kept.step, stored=kept.path, run=kept.run,
                             foreign=kept.run is not None and kept.run != self.run)
        if shared and self.store is not None:
            self._write(baseline_store.write, self.store, base, target)
        return base

    def _write(self, write, where: Path, base: PlainBaseline, target) -> None:
        """`write(where, base, target)`; a full or read-only disk costs a later process a plain pass, nothing more."""
        try:
            write(where, base, target)
        except OSError as e:
            note = f"plain baseline not kept in {where} ({type(e).__name__}: {e})"
            self.store_note = f"{self.store_note}; {note}" if self.store_note else note

    def keep_baseline(self, target, prompts: list[list[int]], max_new_tokens: int, graphs: bool,
                      plain: BatchDecode, step: int | None) -> None:
        """Keep `plain` (a decode just measured) as the baseline, unless one is kept already; and in
        the store (a stored baseline is taken only where it applies, so one that did not is replaced)."""
        if self.baseline is None:
            from dflash.eval import baseline_store

            self.baseline = PlainBaseline(target, target_stamp(target), tuple(map(tuple, prompts)), max_new_tokens,
                                          graphs, plain.generations, plain.seconds - plain.setup_s, plain.setup_s,
                                          step, run=self.run)
            if self.store is not None:
                self._write(baseline_store.write, self.store, self.baseline, target)
            if self.shared is not None:
                self._write(baseline_store.write_shared, self.shared, self.baseline, target)

    def record(self, plain: BatchDecode | None, spec: BatchDecode, base: PlainBaseline | None, warm_up_s: float | None
               ) -> None:
        """An eval ended: `plain` measured (None: `base` reused), `spec` decoded; `warm_up_s` the
        warm-up's seconds (None: no warm-up ran)."""
        decodes = [d for d in (plain, spec) if d is not None]
        self.evals += 1
        self.last = EvalCost(graphs_captured=sum(d.captured for d in decodes),
                             graphs_reused=sum(d.reused for d in decodes),
                             graph_setup_s=sum(d.setup_s for d in decodes),
                             plain_baseline="measured" if base is None else base.source(),
                             warmed_up=warm_up_s is not None,
                             parts_s=(("warm_up", warm_up_s or 0.0), ("plain", plain.seconds if plain else 0.0),
                                      ("speculative", spec.seconds)))

    def record_reference(self, seconds: float) -> None:
        """An eval ran the batch-1 reference (a target batching cannot take) in `seconds`, plain and
        speculative passes together: nothing kept or reused."""
        self.evals += 1
        self.last = EvalCost(graphs_captured=0, graphs_reused=0, graph_setup_s=0.0, plain_baseline="measured",
                             warmed_up=True, parts_s=(("reference", seconds),))
