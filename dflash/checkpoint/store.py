"""Checkpoints: an HF-style drafter export that serving engines load, plus the exact training state.

Layout of a run directory:

    RUN/config.toml                      the resolved training config (also in every checkpoint)
    RUN/metrics.jsonl                    one row per logged step
    RUN/checkpoints/step_000100/
        config.json                      Qwen3 fields + DFlash fields (SGLang DFLASH / vLLM dflash), and
                                         `dflash_training`: what it was trained with (dflash.check.record)
        model.safetensors                layers.*, fc, hidden_norm, norm (reference names)
        training_state.pt                fp32 master weights, optimizer, step (for --resume)
        train_config.toml                the training config
        manifest.json                    size + xxh3-128 of each file above (dflash/checkpoint/manifest.py)
    RUN/checkpoints/latest               the name of the newest complete checkpoint

A checkpoint directory is written under a temporary name (`.step_NNNNNN.partial-PID`, every file
fsynced) and renamed into place (atomic on POSIX), then `latest` is replaced atomically: a crash
never leaves a half-written checkpoint behind, and the next run that owns the run directory removes
the staging directories of killed saves (dflash.checkpoint.retention). An existing directory of the
same name is moved aside to `<name>.bak-<time>`, never deleted. Which checkpoints are kept:
dflash.checkpoint.retention (`checkpoint.keep_last`, `checkpoint.export_every`); how a save runs
beside training: dflash.checkpoint.writer.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from compilewatch import BadInput, FILE_MODE, atomic_write_json, atomic_write_text
from dflash.checkpoint import manifest
from dflash.model.drafter import DFlashDrafter, DrafterSpec

EXPORT_FILES = ("config.json", "model.safetensors")
STATE_FILE = "training_state.pt"
CONFIG_FILE = "train_config.toml"
RECORD_KEY = "dflash_training"  # config.json: the training record (dflash.check.record.RECORD_KEY)


def export_config(spec: DrafterSpec, dtype: torch.dtype, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for the exported drafter: a Qwen3 config plus the DFlash fields serving engines read;
    `record`: what `dflash check` compares at serving time (dflash.check.record.build_record), kept
    under `dflash_training` (a key SGLang and vLLM ignore)."""
    import transformers

    sliding = any(t == "sliding_attention" for t in spec.layer_types)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        # transformers 4.x / SGLang read rope_scaling, transformers 5 / vLLM rope_parameters: say it in both
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling else None,
        "rope_parameters": {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta},
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "layer_types": list(spec.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": spec.sliding_window if sliding else None,
        "max_window_layers": spec.num_hidden_layers,
        "num_target_layers": spec.num_target_layers,
        "block_size": spec.block_size,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids)},
        "dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype],
        "transformers_version": transformers.__version__,
        **({RECORD_KEY: record} if record is not None else {}),
    }


def spec_from_config(cfg: Any, where: str = "config.json") -> DrafterSpec:
    """Read a DrafterSpec back from an exported config.json (every field type-checked and bounded: BadInput)."""
    try:
        d = cfg["dflash_config"]
        rope = cfg.get("rope_parameters")
        fields = {
            "hidden_size": cfg["hidden_size"], "num_hidden_layers": cfg["num_hidden_layers"],
            "num_attention_heads": cfg["num_attention_heads"], "num_key_value_heads": cfg["num_key_value_heads"],
            "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
            "rms_norm_eps": cfg["rms_norm_eps"],
            "rope_theta": cfg["rope_theta"] if "rope_theta" in cfg else rope.get("rope_theta") if isinstance(rope, dict) else None,
            "max_position_embeddings": cfg["max_position_embeddings"], "block_size": cfg["block_size"],
            "num_target_layers": cfg["num_target_layers"], "target_layer_ids": d["target_layer_ids"],
            "mask_token_id": d["mask_token_id"], "layer_types": cfg["layer_types"],
            "sliding_window": cfg.get("sliding_window"),
            "rope_scaling": _rope_scaling(cfg), "attention_bias": cfg.get("attention_bias", False),
        }
    except (KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{where} is not a DFlash drafter config (missing or bad {e})",
                       hint="export a checkpoint with `dflash train`; it writes config.json with dflash_config") from None
    return checked_spec(fields, where)


def checked_spec(fields: Any, where: str) -> DrafterSpec:
    """A DrafterSpec from untrusted values: each field's type, the spec's own rules, and sane bounds
    and ranges (dflash.checkpoint.export_check.check_spec) checked before anything is allocated (BadInput)."""
    from compilewatch import dataclass_from_json
    from dflash.checkpoint.export_check import check_spec

    hint = "the export is damaged or was not written by dflash: use another checkpoint"
    try:
        spec = dataclass_from_json(DrafterSpec, fields, where)
    except BadInput as e:  # a field of the wrong type (a number past float's range is one)
        raise BadInput(e.message, hint=e.hint or hint) from None
    except (ValueError, ZeroDivisionError) as e:
        raise BadInput(f"{where}: not a drafter spec ({str(e)[:200]})", hint=hint) from None
    return check_spec(spec, where)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    rs = cfg.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise TypeError("rope_scaling (not an object)")
    rp = rs or {k: v for k, v in (cfg.get("rope_parameters") or {}).items() if k != "rope_theta"}
    if not isinstance(rp, dict) or rp.get("rope_type", rp.get("type", "default")) == "default":
        return None
    return dict(rp)


STAGE_RE = re.compile(r"^\.step_\d+\.partial-\d+$")  # a save in progress (or killed mid-way)
DELETING_RE = re.compile(r"^\.step_\d+\.deleting-\d+$")  # a checkpoint retention is removing
STEP_RE = re.compile(r"^step_(\d+)$")  # a published checkpoint (complete: renamed into place whole)


def _stage_dir(final: Path) -> Path:
    stage = final.parent / f".{final.name}.partial-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)  # our own leftover staging dir from this pid, never a user's checkpoint
    final.parent.mkdir(exist_ok=True)  # RUN/checkpoints; RUN itself must still be there: a run directory
    stage.mkdir()  # that vanished (deleted, unmounted) fails the save instead of being recreated elsewhere
    return stage


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(stage: Path, final: Path) -> None:
    for f in stage.iterdir():  # files written directly (training state) get the same mode as atomic ones
        os.chmod(f, FILE_MODE)
    fsync_dir(stage)
    if final.exists():
        final.rename(final.with_name(f"{final.name}.bak-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.replace(stage, final)
    fsync_dir(final.parent)


def _write_synced(path: Path, write) -> None:
    """Create `path` (inside a staging directory), write it with `write(fh)`, flush and fsync."""
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_export(directory: Path, drafter: DFlashDrafter, dtype: torch.dtype) -> None:
    """config.json + model.safetensors of a live drafter into an existing directory."""
    write_export_state(directory, {k: v.detach().cpu() for k, v in drafter.state_dict().items()}, drafter.spec, dtype)


def write_export_state(directory: Path, model: dict[str, torch.Tensor], spec: DrafterSpec, dtype: torch.dtype,
                       record: dict[str, Any] | None = None) -> None:
    """config.json + model.safetensors from host tensors (fp32 master weights, cast to `dtype` here);
    `record`: the training record config.json carries (export_config)."""
    from safetensors.torch import save_file

    path = directory / "model.safetensors"
    save_file({k: v.to(dtype).contiguous() for k, v in model.items()}, str(path), metadata={"format": "pt"})
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    atomic_write_json(directory / "config.json", export_config(spec, dtype, record))


def save_checkpoint(run_dir: Path, step: int, model: dict[str, torch.Tensor], spec: DrafterSpec,
                    export_dtype: torch.dtype, training_state: dict[str, Any], config_toml: str,
                    data: dict[str, Any] | None = None) -> Path:
    """Write checkpoints/step_NNNNNN atomically and point `latest` at it; returns its path. `model`:
    the drafter's weights on the host (the export); `training_state`: what `Trainer.state_dict` holds,
    tensors on the host. The staging directory is fsynced file by file, its manifest (sizes and
    checksums, dflash.checkpoint.manifest) is the last file written, then it is renamed into place.
    config.json records what the drafter was trained with (the target tokenizer, chat template and
    DFlash fields: dflash.check.record.build_record, from `config_toml`) for `dflash check`. `data`: what
    the run trains on (path, content digest, record counts), kept in the manifest for --resume to compare
    (dflash.checkpoint.data_check)."""
    from dflash.check.record import build_record
    from dflash.checkpoint import manifest

    ckdir = Path(run_dir) / "checkpoints"
    final = ckdir / f"step_{step:06d}"
    stage = _stage_dir(final)
    try:
        write_export_state(stage, model, spec, export_dtype, build_record(config_toml, spec))
        _write_synced(stage / STATE_FILE, lambda fh: torch.save(training_state, fh))
        atomic_write_text(stage / CONFIG_FILE, config_toml)
        manifest.record(stage, [*EXPORT_FILES, STATE_FILE, CONFIG_FILE], data=data)  # last: sizes + checksums
        _publish(stage, final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    atomic_write_text(ckdir / "latest", final.name + "\n")
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's resumable checkpoints (a published step_NNNNNN with its training state), oldest first."""
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckdir.iterdir()
             if (m := STEP_RE.match(p.name)) and p.is_dir() and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def step_number(name: str) -> int | None:
    """The step of a checkpoint directory named `step_NNNNNN` (None for any other name)."""
    m = re.fullmatch(r"step_(\d+)", name)
    return int(m.group(1)) if m else None


def _damage(ck: Path, need: tuple[str, ...]) -> str | None:
    """Why `ck` is not a usable checkpoint holding `need` (None: it is). Only stats: never opens a file."""
    if not ck.is_dir():
        return "it does not exist" if not os.path.lexists(ck) else "it is not a directory"
    for name in need:
        f = ck / name
        if not f.is_file():  # stat, not open: a FIFO is reported, never read
            what = "is missing" if not os.path.lexists(f) else "is a directory" if f.is_dir() else "is not a regular file"
            return f"its {name} {what}"
    return None


def latest_checkpoint(run_dir: Path, need: tuple[str, ...] = (STATE_FILE,)) -> Path | None:
    """The newest checkpoint of a run directory (the one `checkpoints/latest` names; without that
    pointer, the highest step_N), or None when it has none. BadInput when that checkpoint is damaged
    (a file of `need` missing or not a regular file): an older one is never used silently instead."""
    ckdir = Path(run_dir) / "checkpoints"
    pointer = ckdir / "latest"
    older = sorted((p for p in ckdir.glob("step_*") if step_number(p.name) is not None),
                   key=lambda p: step_number(p.name))
    if os.path.lexists(pointer):
        if not pointer.is_file():
            raise BadInput(f"{str(pointer)!r} is not a file (it names the newest checkpoint)",
                           hint=_older_hint(pointer, older))
        with open(pointer, encoding="utf-8", errors="replace") as fh:
            name = fh.read(256).strip()  # a step_NNNNNN name; never follow a path out of checkpoints/
        if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
            raise BadInput(f"{str(pointer)!r} does not name a checkpoint ({name[:60]!r})", hint=_older_hint(pointer, older))
        cand = ckdir / name
        cand = _published_after(pointer, cand, older, need)
    elif older:
        cand = older[-1]
    else:
        return None
    problem = _damage(cand, need)
    if problem:
        raise BadInput(f"the newest checkpoint {str(cand)!r} is damaged: {problem}",
                       hint=_older_hint(pointer, [p for p in older if p != cand]))
    return cand


def _older_hint(pointer: Path, older: list[Path]) -> str:
    if not older:
        return "no other checkpoint to resume from: start the run again with another --out"
    return (f"to continue from an older checkpoint, write its name into {str(pointer)!r} "
            f"(there: {', '.join(p.name for p in older[-3:])})")


def _published_after(pointer: Path, cand: Path, steps: list[Path], need: tuple[str, ...]) -> Path:
    """`cand` (what `latest` names), or the newest checkpoint published after `latest` was last
    written: a save publishes its directory (renamed whole from staging), then rewrites `latest`, so
    a kill between the two leaves `latest` one save behind and older than that directory. A `latest`
    written after the newer directory (someone rewinding the run by hand) is kept."""
    n = step_number(cand.name)
    if n is None:
        return cand
    try:
        written = pointer.stat().st_mtime_ns
        newer = [p for p in steps if (step_number(p.name) or 0) > n and p.stat().st_mtime_ns > written
                 and all((p / f).is_file() for f in need)]
    except OSError:
        return cand
    return newer[-1] if newer else cand



def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint path, a run directory or its checkpoints/ folder (their
    latest checkpoint), or the `checkpoints/latest` pointer file itself."""
    p = Path(path).expanduser()
    if p.name == "latest" and p.is_file():
        p = p.parent.parent  # RUN/checkpoints/latest names RUN's newest checkpoint
    elif p.name == "checkpoints" and p.is_dir() and not (p / "config.json").is_file():
        p = p.parent
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        return p
    if p.is_dir():
        latest = latest_checkpoint(p, need=EXPORT_FILES)
        if latest is not None:
            return latest
    raise BadInput(f"{str(p)!r} is not a dflash checkpoint or run directory",
                   hint="expected a directory with config.json + model.safetensors, or a run directory with checkpoints/")


def read_export_spec(path: Path) -> DrafterSpec:
    """The drafter spec of an export, checked against its own weights before anything is allocated:
    config.json read capped and every field typed and bounded, model.safetensors' header naming
    exactly the tensors (and shapes) that spec implies (dflash.checkpoint.export_check)."""
    from compilewatch import loads_json, read_text
    from dflash.checkpoint.export_check import check_weights

    path = Path(path)
    fd, _st = manifest.open_regular(path / "config.json", "drafter config.json")  # a FIFO is never read
    os.close(fd)
    cfg = loads_json(read_text(path / "config.json", limit=16 << 20, what="drafter config.json"), str(path / "config.json"))
    spec = spec_from_config(cfg, str(path / "config.json"))
    check_weights(path / "model.safetensors", spec)
    return spec


def load_export(path: Path, device: torch.device | str = "cpu", spec: DrafterSpec | None = None) -> DFlashDrafter:
    """An exported drafter (config.json + model.safetensors) as a DFlashDrafter in fp32. `spec`: what
    `read_export_spec(path)` returned (read again when not given)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from compilewatch import one_line

    spec = read_export_spec(path) if spec is None else spec
    drafter = DFlashDrafter(spec)
    try:  # safetensors holds tensors only (no code); a damaged file is bad input
        state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise BadInput(f"cannot read {path / 'model.safetensors'}: {one_line(e, 200)}") from None
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise BadInput(f"{path / 'model.safetensors'} does not match its config.json",
                       hint=f"missing: {missing[:4]}, unexpected: {unexpected[:4]}")
    return drafter.to(device)


def load_training_state(path: Path) -> dict[str, Any]:
    """The training state of a checkpoint, loaded with `weights_only=True`: tensors and plain Python
    values only, so a crafted training_state.pt cannot run code. BadInput for anything that is not
    the dict `Trainer.state_dict` writes (step, model, optimizer, spec). Only a regular file is opened
    (a FIFO never blocks). Whether its tensors fit the drafter and optimizer is
    dflash.checkpoint.state_check's (Trainer.load_state_dict runs it before changing anything)."""
    import pickle

    where = str(path / STATE_FILE)
    fd, st = manifest.open_regular(path / STATE_FILE, "the training state")  # a FIFO or a directory: BadInput
    try:
        with os.fdopen(fd, "rb") as fh:  # checked a regular file; mmap reads it by path: tensors are paged in as
            # they are copied to the device (no full 12 GB host copy first, at 8B)
            _check_state_archive(fh, st.st_size, where)  # first: torch.load's reads are then bounded by the file
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, ValueError, TypeError, AttributeError, ImportError, KeyError, IndexError,
            pickle.UnpicklingError) as e:
        from compilewatch import one_line

        raise BadInput(f"cannot read the training state {where!r}: {one_line(f'{type(e).__name__}: {e}', 300)}",
                       hint="it is not a training_state.pt that `dflash train` wrote (or it is damaged); "
                            "resume from another checkpoint") from None
    problems = []
    if not isinstance(state, dict):
        problems.append(f"a {type(state).__name__}, not a dict")
    else:
        for key, kind in (("step", int), ("model", dict), ("optimizer", dict), ("spec", dict)):
            if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
                problems.append(f"{key!r} missing or not a {kind.__name__}")
        if not problems:
            from dataclasses import asdict

            try:
                state["spec"] = asdict(checked_spec(state["spec"], "spec"))  # keys it does not know are dropped
            except BadInput as e:
                problems.append(f"'spec' is not a drafter spec ({e.message})")
    if problems:
        raise BadInput(f"{where!r} is not a dflash training state: {'; '.join(problems)}"[:600],
                       hint="resume from a checkpoint `dflash train` wrote")
    return state


def checkpoint_config(ck: Path, overrides: dict[str, Any] | None = None):
    """The config a checkpoint was trained with (its train_config.toml, then `overrides`), or None when it
    has none. BadInput when the name is there but is not a regular file (a FIFO, a directory: never read;
    it used to read as "has no train_config.toml") or does not read as a config."""
    from dflash.config import load_toml

    path = Path(ck) / CONFIG_FILE
    if not os.path.lexists(path):
        return None
    fd, _st = manifest.open_regular(path, "the checkpoint's training config")
    os.close(fd)
    return load_toml(path, overrides)


MAX_STATE_PICKLE = 64 << 20  # a training state's data.pkl describes its tensors: ~100 bytes each (KBs to a few MB)


def _check_state_archive(fh: Any, size: int, where: str) -> None:
    """BadInput unless `fh` (`size` bytes) is a zip archive as torch.save writes it: every record stored
    uncompressed inside the file and the pickle at most MAX_STATE_PICKLE bytes. torch.load inflates a
    compressed record into memory whole, whatever its size: a few MB of deflated zeros would ask for
    gigabytes before weights_only looks at anything. Reads the zip's directory only."""
    import zipfile

    hint = ("it is not a training_state.pt that `dflash train` wrote (or it is damaged); resume from another "
            "checkpoint (write its name into checkpoints/latest)")
    try:
        infos = zipfile.ZipFile(fh).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        from compilewatch import one_line

        raise BadInput(f"cannot read the training state {where!r}: not a zip archive (torch.save's format): "
                       f"{one_line(e, 160)}", hint=hint) from None
    for info in infos:
        name = info.filename[:80]
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise BadInput(f"the training state {where!r} holds a compressed record ({name!r}): torch.save "
                           "stores every record uncompressed, and inflating it is not bounded by the file's size",
                           hint=hint)
        if info.header_offset + info.compress_size > size:
            raise BadInput(f"the training state {where!r}: record {name!r} ends past the file's {size} bytes",
                           hint=hint)
        if info.filename.endswith("/data.pkl") and info.file_size > MAX_STATE_PICKLE:
            raise BadInput(f"the training state {where!r}: its pickle {name!r} is {info.file_size} bytes, more "
                           f"than the {MAX_STATE_PICKLE >> 20} MiB a training state's description of its tensors "
                           "takes", hint=hint)
    fh.seek(0)


def check_compatible(spec: DrafterSpec, target_hidden: int, target_layers: int, layer_ids: tuple[int, ...],
                     where: str, target_vocab: int | None = None) -> None:
    """BadInput when a checkpoint's drafter does not fit the target (hidden size, depth, taps, and the
    mask token id against the target's vocabulary when `target_vocab` is given)."""
    problems = []
    if spec.hidden_size != target_hidden:
        problems.append(f"hidden size {spec.hidden_size} vs the target's {target_hidden}")
    if tuple(spec.target_layer_ids) != tuple(layer_ids):
        problems.append(f"taps {list(spec.target_layer_ids)} vs {list(layer_ids)}")
    if spec.num_target_layers != target_layers:
        problems.append(f"trained on a {spec.num_target_layers}-layer target, this one has {target_layers}")
    if target_vocab is not None and not 0 <= spec.mask_token_id < target_vocab:
        problems.append(f"mask token id {spec.mask_token_id} is past the target's {target_vocab}-token vocabulary")
    if problems:
        raise BadInput(f"the checkpoint {where} does not match the target: " + "; ".join(problems),
                       hint="use the target (and target.layer_ids) the drafter was trained with")
