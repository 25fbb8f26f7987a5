"""Whether a resumed run trains on the data its checkpoint was saved with.

Every checkpoint's manifest.json records the data the run trained on ("data": its path, its content
digest, its records and how many were kept; dflash.checkpoint.manifest). The digest is the one the
data cache keys on (dflash.data.cache.source_digest): "file:" + the xxh3-128 of the JSONL file's bytes,
or "embedded:" + the embedded conversations'. At --resume the data is hashed again (once: the cache
key reuses it) and compared, before anything is tokenized or regenerated:

- the same digest: nothing is said;
- another digest under the same path (the file edited in place: records changed, added, removed or
  reordered): refused, BadInput (exit 2), unless `data.accept_changed = true`, which goes on for that
  one resume (the run's config.toml keeps false, so the next change is asked about again). Why refuse:
  a resume repeats an uninterrupted run only on the same data; on other data the epoch's order maps
  the remaining steps onto other records (some trained twice this epoch, some never), the held-out
  eval prompts (the last records) move into training or out of it, and with an epochs-based schedule
  the run's length (and so its learning-rate schedule) changes. An edit under the same name is most
  often not meant for the run (a regen still writing the file, a `git pull`, a colleague's fix);
- another path (`--data`, an edited config.toml): said, not refused: naming other data is the act;
- no record (a checkpoint saved before dflash recorded it): "not recorded", resumed as before.

The comparison is said on the resume summary's `changed` line and written to metrics.jsonl as a
"data_check" event (dflash.training.trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compilewatch import BadInput

SAME, CHANGED, REPLACED, NOT_RECORDED = "same", "changed", "replaced", "not recorded"


def _short(digest: str | None) -> str:
    if not digest:
        return "?"
    hexd = digest.partition(":")[2]
    return f"xxh3 {hexd[:12]}" if hexd else digest[:16]


@dataclass(frozen=True)
class DataCheck:
    """The data a resume trains on against what its checkpoint recorded."""
    checkpoint: str
    status: str  # SAME, CHANGED (same path, other contents), REPLACED (another path), NOT_RECORDED
    path: str  # the data now
    digest: str
    saved: dict[str, Any] | None  # the checkpoint's record ({"path", "digest", "records", "kept"}), if any

    @property
    def changed(self) -> bool:
        return self.status in (CHANGED, REPLACED)

    def line(self) -> str | None:
        """One line for the resume summary (None when the data is the same)."""
        name, s = Path(self.checkpoint).name, self.saved
        if self.status == NOT_RECORDED:
            return (f"not recorded in {name} (saved before dflash recorded the data it trained on, or a record "
                    "that does not read): not compared")
        if self.status == CHANGED:
            return (f"data since {name}: {self.path!r} was edited in place: {_short(self.digest)} now, "
                    f"{_short(s['digest'])} and {s['records']} records when saved")
        if self.status == REPLACED:
            return (f"data since {name}: {self.path!r} ({_short(self.digest)}) instead of {s['path']!r} "
                    f"({_short(s['digest'])}, {s['records']} records)")
        return None

    def event(self, now: dict[str, Any] | None, accepted: bool) -> dict[str, Any]:
        """The metrics.jsonl "data_check" event: the record saved, the data now (`now`: its record)."""
        return {"status": self.status, "checkpoint": self.checkpoint, "saved": self.saved,
                "now": now or {"path": self.path, "digest": self.digest}, "accepted": accepted}


def compare(checkpoint: Path, path: str, digest: str) -> DataCheck:
    """The data at `path` (its digest, dflash.data.cache.source_digest) against checkpoint's record."""
    from dflash.checkpoint.manifest import read_data

    saved = read_data(checkpoint)
    if saved is None:
        status = NOT_RECORDED
    elif saved["digest"] == digest:
        status = SAME
    else:
        status = CHANGED if _same_path(saved["path"], path) else REPLACED
    return DataCheck(str(checkpoint), status, path, digest, saved)


def _same_path(a: str, b: str) -> bool:
    if a.startswith("embedded:") or b.startswith("embedded:"):
        return a == b
    return Path(a).expanduser().absolute() == Path(b).expanduser().absolute()


def refuse_unaccepted(check: DataCheck, accepted: bool) -> None:
    """BadInput when the data under the checkpoint's own path changed and `accepted` (data.accept_changed)
    is not set: the module docstring says why."""
    if check.status != CHANGED or accepted:
        return
    s = check.saved or {}
    raise BadInput(
        f"--resume: the training data changed since {Path(check.checkpoint).name} was saved: {check.path!r} now "
        f"holds other contents ({_short(check.digest)}; {_short(s.get('digest'))} and {s.get('records')} records "
        "then). Resumed on it, the rest of the run would train on other records than an uninterrupted run, in "
        "another order, and records would move between the held-out eval prompts and training",
        hint="put back the data the run trained on; or go on with it as it is now: --set data.accept_changed=true "
             "(this resume only: its checkpoints then record the new data); or start a new run (another --out)")


def data_since_checkpoint(cfg: Any) -> DataCheck | None:
    """What a resume of `cfg` (a resumed run's config) would find about its data, for the summary: the
    newest checkpoint's record against the data now (hashed here; the run's own check reuses the digest).
    None when there is no checkpoint or the data cannot be read (the resume proper says what is wrong)."""
    from dflash.checkpoint.store import latest_checkpoint
    from dflash.data.cache import source_digest

    try:
        latest = latest_checkpoint(Path(cfg.checkpoint.out_dir))
        if latest is None:
            return None
        digest, _ = source_digest(cfg.data)
        return compare(latest, _absolute(cfg.data.path), digest)
    except (BadInput, OSError):
        return None


def _absolute(path: str) -> str:
    """A data path as a run records it (dflash.training.build.absolute_paths)."""
    if path.startswith("embedded:") or Path(path).expanduser().is_absolute():
        return path
    return str(Path(path).expanduser().absolute())
