"""dflash.training.warmup brings the drafter's compiled code in while the target's weights are read, and
changes nothing the run computes; dflash.model.prefetch reads the weights into the page cache from the
start of the process. CPU (the warm-up is called directly there: on CPU nothing is compiled, so the start
runs it only when told to). Threads are ordered with Events, never sleeps."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from dflash.model import prefetch
from dflash.training import build, warmup
from dflash.training.trainer import Trainer
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 - fixtures
from tests.test_fast_start import _save_qwen3

ROOT = Path(__file__).resolve().parents[1]
WAIT = 120  # seconds: a generous bound on an Event that a correct thread sets at once


def _steps(tr: Trainer, n: int) -> list[tuple]:
    out = []
    for s in range(n):
        m = tr.train_step(tr.micro_batches(s))
        out.append((m.loss, m.grad_norm, m.accuracy))
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_the_warm_up_changes_nothing_the_run_computes(tmp_path, chat_file, pack):
    runs = {}
    for warm in (True, False):
        cfg = small_config(tmp_path / f"run-{warm}", chat_file, **{"data.pack": pack})
        tr = Trainer.from_config(cfg)
        try:
            before = {k: v.clone() for k, v in tr.drafter.state_dict().items()}
            rng = torch.get_rng_state()
            if warm:  # the first step's own micro-batch (what the start warms), then every warm-up shape
                batches = tr.dataset.step_batches(0, cfg.train.grad_accum)[:1] + tr.dataset.warm_batches()
                ran = warmup.warm_drafter(cfg, tr.drafter, batches, vocab_size=tr.target.head.weight.shape[0],
                                          dtype=tr.target.dtype, device=tr.device)
                assert ran == len(batches) > 1
            assert all(p.grad is None for p in tr.drafter.parameters())
            assert all(torch.equal(v, before[k]) for k, v in tr.drafter.state_dict().items())
            assert torch.equal(torch.get_rng_state(), rng)
            assert not tr.optimizer.state  # AdamW untouched
            runs[warm] = _steps(tr, 2)
        finally:
            tr.close()
    assert runs[True] == runs[False]  # bit for bit: the same data, init and arithmetic


def test_the_warm_up_stops_before_the_next_shape_once_told(tmp_path, chat_file):
    cfg = small_config(tmp_path / "run", chat_file)
    tr = Trainer.from_config(cfg)
    try:
        batches = tr.dataset.warm_batches()
        asked = []

        def until() -> bool:
            asked.append(1)
            return len(asked) > 1  # the weights are in after the first shape

        kw = dict(vocab_size=tr.target.head.weight.shape[0], dtype=tr.target.dtype, device=tr.device)
        assert warmup.warm_drafter(cfg, tr.drafter, batches, until=until, **kw) == 1
        assert warmup.warm_drafter(cfg, tr.drafter, batches, until=lambda: True, **kw) == 0
        assert all(p.grad is None for p in tr.drafter.parameters())
    finally:
        tr.close()


def test_the_start_warms_the_drafter_only_while_the_weights_are_read(tmp_path, chat_file, monkeypatch):
    """A directory target (its weights read in their own stage). The read is held until the warm-up has
    run, so the overlap is certain; a second start whose read ends first runs no warm-up."""
    import dflash.model.target_load as target_load

    target = _save_qwen3(tmp_path / "q")
    monkeypatch.setattr(warmup, "pays", lambda drafter, device: True)  # CPU: nothing compiled, told to run anyway
    warmed, release = threading.Event(), threading.Event()
    real_warm, real_read = warmup.warm_drafter, target_load.read_target_weights
    calls = []

    def warm(*a, **k):
        calls.append(k["until"]())
        out = real_warm(*a, **k)
        warmed.set()
        return out

    def held_read(*a, **k):
        if hold:
            assert release.wait(WAIT), "the warm-up did not run while the weights were read"
        return real_read(*a, **k)

    real_build = build.build_drafter
    monkeypatch.setattr(warmup, "warm_drafter", warm)
    monkeypatch.setattr(target_load, "read_target_weights", held_read)
    events = []
    hold = True
    cfg = small_config(tmp_path / "run-held", chat_file, **{"target.path": str(target)})
    releaser = threading.Thread(target=lambda: (warmed.wait(WAIT), release.set()), daemon=True)
    releaser.start()
    t = build.build_trainer(cfg, Trainer, on_event=lambda k, d: events.append((k, d)))
    t.close()
    releaser.join(WAIT)
    assert calls == [False]  # it ran, and the weights were still being read when it started
    assert "drafter warm-up" in {d["name"] for k, d in events if k == "phase-done"}
    # the weights already in when the drafter is built: no warm-up (a page-cached start does not wait for one)
    hold = False
    calls.clear()
    loads = []
    real_init = target_load.TargetLoad.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        loads.append(self)

    def late_drafter(*a, **k):
        loads[-1].stages["weights"].join()  # the read's thread has ended
        return real_build(*a, **k)

    monkeypatch.setattr(target_load.TargetLoad, "__init__", init)
    monkeypatch.setattr(build, "build_drafter", late_drafter)
    cfg = small_config(tmp_path / "run-late", chat_file, **{"target.path": str(target)})
    build.build_trainer(cfg, Trainer).close()
    assert loads and calls == []


# ---------------------------------------------------------------- prefetch
def test_prefetch_reads_every_byte_of_the_targets_shards(tmp_path):
    from transformers import Qwen3ForCausalLM

    path = _save_qwen3(tmp_path / "q")
    Qwen3ForCausalLM.from_pretrained(str(path)).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    files = prefetch.safetensors_files(tmp_path / "sharded")
    assert files is not None and len(files) > 1
    p = prefetch.Prefetch(files, readers=3, chunk=16 << 10).start()
    assert p.done.wait(WAIT)
    assert p.bytes_read == sum(f.stat().st_size for f in files)


def test_prefetch_declines_what_it_cannot_help_and_survives_what_it_cannot_read(tmp_path, monkeypatch):
    assert prefetch.prefetch_weights("embedded:tiny") is None
    assert prefetch.prefetch_weights(str(tmp_path)) is None  # no safetensors here
    path = _save_qwen3(tmp_path / "q")
    monkeypatch.setattr(prefetch, "_available_memory", lambda: 1000)  # far less than the files
    assert prefetch.prefetch_weights(str(path)) is None
    monkeypatch.setattr(prefetch, "_available_memory", lambda: None)  # unknown: no bound
    p = prefetch.prefetch_weights(str(path))
    assert p is not None and p.done.wait(WAIT)
    gone = prefetch.Prefetch([path / "model.safetensors", tmp_path / "missing.safetensors"], readers=2)
    (path / "model.safetensors").unlink()  # listed, then gone: the threads end, nothing is raised
    assert gone.start().done.wait(WAIT) and gone.bytes_read == 0


def test_a_stopped_prefetch_reads_nothing_more(tmp_path):
    path = _save_qwen3(tmp_path / "q")
    p = prefetch.Prefetch(prefetch.safetensors_files(path), readers=2, chunk=4 << 10)
    p.stop()
    assert p.start().done.wait(WAIT) and p.bytes_read == 0


def test_prefetch_imports_no_torch():
    code = "import sys, dflash.model.prefetch; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120).returncode == 0


def test_a_run_starts_the_prefetch_first_and_stops_it_once_the_trainer_is_built(tmp_path, chat_file, monkeypatch):
    """dflash.run.train: the prefetch starts before torch's imports are waited for, and is stopped whether
    the build succeeds or fails."""
    import dflash.run as run
    from compilewatch import BadInput
    from dflash.training import preload

    target = _save_qwen3(tmp_path / "q")
    order = []

    class Fake:
        def stop(self):
            order.append("stop")

    def fake_prefetch(path):
        order.append(("prefetch", path))
        return Fake()

    real_start = preload.start_imports

    def start_imports(*a, **k):
        order.append("imports")
        return real_start(*a, **k)

    monkeypatch.setattr(prefetch, "prefetch_weights", fake_prefetch)
    monkeypatch.setattr(preload, "start_imports", start_imports)

    def failing(*a, **k):
        raise BadInput("stop here")

    monkeypatch.setattr(Trainer, "from_config", failing)
    cfg = small_config(tmp_path / "run", chat_file, **{"target.path": str(target)})
    with pytest.raises(BadInput, match="stop here"):
        run.train(cfg)
    assert order == [("prefetch", str(target)), "imports", "stop"]


def test_a_resumed_start_warms_the_micro_batch_of_the_step_it_resumes_at(tmp_path, chat_file, monkeypatch):
    import dflash.model.target_load as target_load

    target = _save_qwen3(tmp_path / "q")
    cfg = small_config(tmp_path / "run", chat_file, **{"target.path": str(target), "checkpoint.every": 3})
    first = Trainer.from_config(cfg)
    try:
        first.train(until=3)
    finally:
        first.close()
    monkeypatch.setattr(warmup, "pays", lambda drafter, device: True)
    monkeypatch.setattr(target_load.TargetLoad, "reading", lambda self: True)  # as if the weights were still coming
    seen = []
    monkeypatch.setattr(warmup, "warm_drafter", lambda cfg, drafter, batches, **k: seen.extend(batches) or len(batches))
    t = build.build_trainer(cfg, Trainer, resume=True)
    try:
        assert t.step == 3 and len(seen) == 1
        want = t.micro_batches(3)[0]
        assert torch.equal(seen[0].input_ids, want.input_ids) and torch.equal(seen[0].anchors, want.anchors)
    finally:
        t.close()
