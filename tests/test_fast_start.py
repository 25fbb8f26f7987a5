"""Starts bounded by the machine, not by imports (issue 39): the target's weights go from safetensors
straight to the device, the model is built without allocating or initializing weights, the start's
phases overlap (dflash.training.preload, dflash.model.target_load, dflash.training.build), and none of
it changes what is loaded or which error a bad input gets. CPU; small random Qwen3s saved with
save_pretrained. Threads are ordered with Events, never sleeps."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from compilewatch.errors import BadInput
from dflash.config import TargetConfig
from dflash.model import target as tgt
from dflash.model import weights
from dflash.model.target_load import TargetLoad
from dflash.training import build, preload
from dflash.training.trainer import Trainer
from tests.dflash_helpers import chat_file, small_config, tiny_target  # noqa: F401 - fixtures
from tests.helpers import requires_cuda

ROOT = Path(__file__).resolve().parents[1]
WAIT = 120  # seconds: a generous bound on an Event that a correct thread sets at once


def _save_qwen3(path: Path, *, tied: bool = False, pad_rows: bool = True, generation_config: bool = True,
                seed: int = 3) -> Path:
    from transformers import Qwen3ForCausalLM

    tok = tgt.build_tiny_tokenizer()
    cfg = tgt.tiny_target_config(len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4, head_dim=8,
                                 tie_word_embeddings=tied)
    if not pad_rows:
        cfg.vocab_size = len(tok)  # no spare row: the mask token needs the embeddings resized
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)  # stored in bf16, as real checkpoints are
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if not generation_config:
        (path / "generation_config.json").unlink()
    return path


def _reference(path: Path, dtype: torch.dtype):
    """What the loader did before issue 39: from_pretrained of the directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)


def _assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype.is_floating_point else sa[k],
                           sb[k].view(torch.uint8) if sb[k].dtype.is_floating_point else sb[k]), k  # bit for bit
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys() and all(torch.equal(ba[k], bb[k]) and ba[k].dtype == bb[k].dtype for k in ba)
    ta = a.get_output_embeddings().weight is a.get_input_embeddings().weight
    assert ta == (b.get_output_embeddings().weight is b.get_input_embeddings().weight)
    assert a.config.to_dict() == b.config.to_dict()
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    assert a.training == b.training and a.dtype == b.dtype
    ids = torch.tensor([[5, 9, 14, 2, 40, 41]], device=next(a.parameters()).device)
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied, generation_config", [(False, True), (True, True), (False, False)],
                         ids=["untied", "tied", "no-generation-config"])
def test_weights_straight_from_safetensors_are_bit_identical_to_from_pretrained(tmp_path, monkeypatch, dtype, tied,
                                                                                generation_config):
    """The direct path (a model built with no weights, the file's tensors assigned) gives the
    reference loader's model bit for bit: parameters, buffers (RoPE), ties, config, generation
    config, logits. from_pretrained is refused while it runs: the direct path was taken."""
    from transformers import AutoModelForCausalLM

    path = _save_qwen3(tmp_path / "q", tied=tied, generation_config=generation_config)
    ref = _reference(path, dtype)
    config = tgt.load_config(TargetConfig(path=str(path)))

    def refuse(*a, **k):
        raise AssertionError("from_pretrained ran: the direct path fell back")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    model = tgt._load_dir(path, dtype, torch.device("cpu"), config=config)
    _assert_same_model(model, ref)
    assert not any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    assert all(p.data_ptr() != q.data_ptr() for p in model.parameters() for q in ref.parameters())


def test_a_layout_the_direct_path_does_not_handle_falls_back_to_from_pretrained(tmp_path):
    """A checkpoint whose names are not the model's (here one tensor renamed): model_from_weights
    declines, from_pretrained loads it as before (it warns about the key and initializes it)."""
    from safetensors.torch import load_file, save_file

    path = _save_qwen3(tmp_path / "q")
    state = load_file(str(path / "model.safetensors"))
    state["model.norm.gamma"] = state.pop("model.norm.weight")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = tgt.load_config(TargetConfig(path=str(path)))
    files = weights.safetensors_files(path)
    assert weights.model_from_weights(config, weights.read_weights(files, torch.device("cpu")), torch.float32,
                                      torch.device("cpu")) is None
    model = tgt._load_dir(path, torch.float32, torch.device("cpu"), config=config)
    assert model.state_dict().keys() == _reference(path, torch.float32).state_dict().keys()


def test_sharded_checkpoints_are_read_through_their_index(tmp_path):
    from transformers import Qwen3ForCausalLM

    path = _save_qwen3(tmp_path / "q")
    model = Qwen3ForCausalLM.from_pretrained(str(path))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    files = weights.safetensors_files(tmp_path / "sharded")
    assert files is not None and len(files) > 1
    config = tgt.load_config(TargetConfig(path=str(path)))
    got = tgt._load_dir(tmp_path / "sharded", torch.float32, torch.device("cpu"), config=config)
    ref = _reference(tmp_path / "sharded", torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), ref.state_dict().values()))


def test_params_on_meta_touches_only_its_own_thread():
    """The registration hook is global; what it does is for the thread that opened it: a module
    built meanwhile in another thread keeps real parameters, and the hook is gone afterwards."""
    inside, other_done = threading.Event(), threading.Event()
    built = {}

    def other():
        assert inside.wait(WAIT)
        built["other"] = nn.Linear(4, 4)
        other_done.set()

    th = threading.Thread(target=other)
    th.start()
    with weights.params_on_meta():
        built["own"] = nn.Linear(4, 4)
        inside.set()
        assert other_done.wait(WAIT)
    th.join()
    assert built["own"].weight.device.type == "meta" and built["other"].weight.device.type == "cpu"
    assert nn.Linear(2, 2).weight.device.type == "cpu" and not weights._HOOK


def _same_target(a, b) -> None:
    _assert_same_model(a.model, b.model)
    assert (a.layer_ids, a.mask_token_id, a.dtype, a.device, a.source, a.notes, a.compile_taps) == \
        (b.layer_ids, b.mask_token_id, b.dtype, b.device, b.source, b.notes, b.compile_taps)
    assert a.tokenizer.get_vocab() == b.tokenizer.get_vocab() and a.tokenizer.chat_template == b.tokenizer.chat_template


@pytest.mark.parametrize("pad_rows", [True, False], ids=["spare-rows", "resized"])
def test_the_staged_load_gives_load_targets_target_and_its_shape_tells_the_truth(tmp_path, pad_rows):
    """TargetLoad (threads) = load_target (one after another), and the shape handed out before the
    weights are in has the loaded Target's values (embedding rows after a resize included)."""
    cfg = TargetConfig(path=str(_save_qwen3(tmp_path / "q", pad_rows=pad_rows)))
    torch.manual_seed(0)  # a resize draws the new rows from the global generator (transformers' mean resizing)
    load = TargetLoad(cfg, 2, "cpu", wait=preload.imports().wait)
    shape = load.shape()
    staged = load.result()
    torch.manual_seed(0)
    _same_target(staged, tgt.load_target(cfg, 2, torch.device("cpu")))
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size, shape.layer_ids, shape.mask_token_id) == \
        (staged.hidden_size, staged.num_layers, staged.vocab_size, staged.layer_ids, staged.mask_token_id)
    assert any("resized" in n for n in staged.notes) == (not pad_rows)
    assert set(load.stages) == {"weights", "target"}


def _no_start_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("dflash-start-")]


def test_a_bad_target_fails_the_staged_load_as_it_fails_load_target(tmp_path):
    """Taps out of range (the shape's error) and a damaged weights file (the read's): the same
    BadInput from the threads as from load_target, and no thread is left reading."""
    path = _save_qwen3(tmp_path / "q")
    bad_taps = TargetConfig(path=str(path), layer_ids=(1, 99))
    for cfg in (bad_taps,):
        with pytest.raises(BadInput) as seq:
            tgt.load_target(cfg, 2, torch.device("cpu"))
        load = TargetLoad(cfg, 2, "cpu")
        with pytest.raises(BadInput) as staged:
            load.shape()
        load.stop()
        assert staged.value.message == seq.value.message and "out of range" in seq.value.message
    (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    cfg = TargetConfig(path=str(path))
    with pytest.raises(BadInput) as seq:
        tgt.load_target(cfg, 2, torch.device("cpu"))
    with pytest.raises(BadInput) as staged:
        TargetLoad(cfg, 2, "cpu").result()
    assert staged.value.message == seq.value.message and "could not load the target" in seq.value.message
    assert _no_start_threads()


def test_an_import_that_fails_in_the_thread_is_raised_where_the_stage_is_needed(tmp_path, monkeypatch):
    """A model-stack module whose import raises: the stages before it are fine, the model stage raises
    that very exception (what the sequential start's import gives), every time it is asked for."""
    (tmp_path / "dflash_broken_module_for_this_test.py").write_text("raise RuntimeError('injected: broken install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(preload, "_MODEL_STACK", ("transformers", "dflash_broken_module_for_this_test"))
    imports = preload.Imports("qwen3").start()
    imports.wait("tokenizer")
    errors = []
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected: broken install") as e:
            imports.wait("model")
        errors.append(e.value)
    assert errors[0] is errors[1]
    with pytest.raises(ValueError, match="unknown import stage"):
        imports.wait("nope")
    imports.thread.join()


def test_the_overlapped_start_builds_the_sequential_starts_run(tmp_path, chat_file, monkeypatch):
    """A fresh run built overlapped and sequentially (a directory target): the same target weights,
    data, drafter init (fp32: never built while the target's model sets the default dtype), notes;
    and the phases that ran in threads say what they ran beside. The target's model is held until
    the drafter is being built, so the overlap is certain, not a matter of timing."""
    import dflash.model.target_load as target_load

    target = _save_qwen3(tmp_path / "q")
    drafter_started = threading.Event()
    real_model, real_drafter = target_load.load_model, build.build_drafter

    def held_model(*a, **k):
        assert drafter_started.wait(WAIT), "the drafter was not built while the target loaded"
        return real_model(*a, **k)

    def drafter(*a, **k):
        drafter_started.set()
        return real_drafter(*a, **k)

    monkeypatch.setattr(target_load, "load_model", held_model)
    monkeypatch.setattr(build, "build_drafter", drafter)
    out = {}
    for overlap in (True, False):
        events = []
        cfg = small_config(tmp_path / f"run-{overlap}", chat_file, **{"target.path": str(target)})
        t = build.build_trainer(cfg, Trainer, overlap=overlap, on_event=lambda k, d: events.append((k, d)))
        try:
            out[overlap] = (t, {d["name"]: d for k, d in events if k == "phase-done"})
            assert all(p.dtype == torch.float32 for p in t.drafter.parameters())
        finally:
            t.close()
    (t1, ph1), (t0, ph0) = out[True], out[False]
    _assert_same_model(t1.target.model, t0.target.model)
    s1, s0 = t1.drafter.state_dict(), t0.drafter.state_dict()
    assert s1.keys() == s0.keys() and all(torch.equal(s1[k], s0[k]) for k in s1)
    assert [s.input_ids.tolist() for s in t1.dataset.samples] == [s.input_ids.tolist() for s in t0.dataset.samples]
    cache = lambda notes: [n.split(": ", 1)[1].split(" ")[0] if n.startswith("data cache") else n for n in notes]  # noqa: E731
    assert cache(t1.notes) == cache(t0.notes)  # the same notes, the same data cache key (built, then hit)
    assert {"data", "drafter"} <= set(ph1["target"]["beside"]) and "weights" in ph1
    assert set(ph0) == {"target", "data", "drafter"} and all("beside" not in d for d in ph0.values())
    assert _no_start_threads()


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from cli.dflash_main import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_bad_input_found_while_the_imports_run_exits_2_without_a_traceback(tmp_path, chat_file):
    """`dflash train` with a target directory that does not exist, and with taps out of range (an
    error raised in the target's thread): exit 2, one error line, no traceback, nothing left of a
    run directory; the imports' thread does not hold the exit."""
    target = _save_qwen3(tmp_path / "q")
    common = ["--data", str(chat_file), "--set", "data.regenerate=false"]
    missing = _cli("--target", str(tmp_path / "nope"), "--out", str(tmp_path / "r1"), *common)
    taps = _cli("--target", str(target), "--set", "target.layer_ids=[1,99]", "--out", str(tmp_path / "r2"), *common)
    for p, words in ((missing, "does not exist"), (taps, "out of range")):
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr and "error:" in p.stderr and words in p.stderr
    assert not (tmp_path / "r1").exists()


_AUDIT = r"""
import json, sys, threading, time
loads = []
sys.addaudithook(lambda ev, args: loads.append((threading.current_thread().name, args[0], time.perf_counter()))
                 if ev == "import" else None)
import dflash
from dflash.training import preload
cfg = dflash.build_config("tiny", None, {"target.path": sys.argv[1], "data.path": sys.argv[2],
                                          "data.regenerate": False, "checkpoint.out_dir": sys.argv[3],
                                          "train.max_steps": 1, "eval.at_end": False, "metrics.tensorboard": False})
dflash.train(cfg)
imports = preload.imports()
t0, t1 = imports.span
print(json.dumps({"span": [t0, t1], "loads": [l for l in loads if t0 <= l[2] <= t1]}))
"""


def test_no_two_threads_import_one_library_at_once(tmp_path, chat_file):
    """While the imports' thread runs, no other thread of the start (the caller's, the target's, the
    weights', the resume read) loads a module of a library that thread loads: two threads inside one
    library's import graph can deadlock on its cycles. A fresh interpreter, a real `dflash.train`."""
    target = _save_qwen3(tmp_path / "q")
    p = subprocess.run([sys.executable, "-c", _AUDIT, str(target), str(chat_file), str(tmp_path / "run")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    loads = json.loads(p.stdout.strip().splitlines()[-1])["loads"]
    ours = {"dflash", "compilewatch", "cli", "tests"}
    by_library: dict[str, set[str]] = {}
    for thread, module, _ in loads:
        top = module.split(".")[0]
        if top not in sys.stdlib_module_names and top not in ours:
            by_library.setdefault(top, set()).add(thread)
    assert any("dflash-start-imports" in t for t in by_library.get("transformers", ())), by_library
    shared = {lib: sorted(t) for lib, t in by_library.items() if len(t) > 1}
    assert shared == {}


def test_the_startup_benchmark_prints_each_runs_phases_and_its_outside_clock():
    """benchmarks/dflash_startup.py's table: process start -> first step done by its own clock (the
    stamp of the CLI's "first step" line), then the phases in the order they ended, with beside."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dflash_startup", ROOT / "benchmarks" / "dflash_startup.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lines = [(3.0, "· target: 2.5 s (at 2.9 s since process start), read beside data, drafter"),
             (1.5, "· data: 0.1 s (at 1.4 s since process start)"),
             (6.2, "· first step: 3.1 s (at 6.1 s since process start)")]
    run = {"name": "warm", "rc": 0, "wall_s": 9.0, "phases": bench.phases_of({"all_lines": lines})}
    table = bench.phase_table([run]).splitlines()
    assert table[0] == "warm: rc 0, process start -> first step done 6.2 s (outside clock), process wall 9.0 s"
    assert [row.split()[0] for row in table[1:]] == ["data", "target", "first"]
    assert table[2].endswith("beside data, drafter")
    assert bench.summarize([run])["first_step_outside_s"] == {"warm": 6.2}


@pytest.mark.gpu
@requires_cuda(bf16=True)
def test_on_cuda_the_weights_go_straight_to_the_device_bit_identical_to_from_pretrained(tmp_path):
    """On the GPU: the direct path (read onto cuda:0 into one reserved allocation, the model built
    with no weights, assigned) against from_pretrained with device_map (what the loader did before),
    bf16; and the staged load's Target against load_target's."""
    from transformers import AutoModelForCausalLM

    path = _save_qwen3(tmp_path / "q")
    dev = torch.device("cuda:0")
    ref = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.bfloat16,
                                               device_map={"": dev})
    config = tgt.load_config(TargetConfig(path=str(path)))
    model = tgt._load_dir(path, torch.bfloat16, dev, config=config)
    assert all(t.device == dev for t in (*model.parameters(), *model.buffers()))
    _assert_same_model(model.cpu(), ref.cpu())
    cfg = TargetConfig(path=str(path))
    staged = TargetLoad(cfg, 2, dev, wait=preload.imports().wait).result()
    _same_target(staged, tgt.load_target(cfg, 2, dev))
