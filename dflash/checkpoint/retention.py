"""Which checkpoints a run keeps, and the leftovers of killed saves.

Rule (`checkpoint.keep_last`, `checkpoint.export_every`), applied by the checkpoint writer right
after a newer checkpoint is published (never before: the newest complete checkpoint is never
touched) and idempotently, so a kill in the middle is finished by the next save:

- the newest `keep_last` complete checkpoints (step_NNNNNN with a training state) stay whole;
- an older one whose step is a multiple of `export_every` (> 0) keeps its export (config.json,
  model.safetensors, train_config.toml): its manifest is rewritten to list only those files first (with
  the digests recorded at its save, never hashed again), then its training state is removed;
- every other older one is renamed to `.step_NNNNNN.deleting-PID` (atomic: it stops being a
  checkpoint at once, never half one) and then removed.

Export-only directories (no training state), `*.bak-*` backups, a `step_NNNNNN` that is a link to a
directory elsewhere, and anything else a user put there are never touched. `clean_leftovers` (run by
the next trainer that holds the run's lock) removes staging directories of killed saves
(`.step_NNNNNN.partial-PID`; one that is a link: the link only), half-removed checkpoints
(`.step_NNNNNN.deleting-PID`) and the temporary files of killed atomic writes in checkpoints/.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from compilewatch import BadInput
from dflash.checkpoint.store import (CONFIG_FILE, DELETING_RE, EXPORT_FILES, STAGE_RE, STATE_FILE, STEP_RE,
                                     complete_checkpoints)

_TMP_RE = re.compile(r"^\.latest\..*\.tmp$")  # compilewatch.atomic_path's temporary for `latest`


@dataclass(frozen=True)
class Pruned:
    removed: tuple[str, ...]  # checkpoint names removed whole
    stripped: tuple[str, ...]  # checkpoint names that kept their export only


def prune(run_dir: Path, keep_last: int, export_every: int = 0,
          spare: set[str] | frozenset[str] = frozenset()) -> Pruned:
    """Apply the rule above to `run_dir`'s checkpoints (see the module docstring). `spare`: names of
    checkpoints neither counted nor touched (another timeline's, past the step a run resumed from)."""
    from dflash.checkpoint import manifest

    # a checkpoint that is a link to a directory elsewhere was put there by someone, not written by a save
    full = [ck for ck in complete_checkpoints(run_dir) if ck.name not in spare and not ck.is_symlink()]
    removed, stripped = [], []
    for ck in full[:-keep_last] if keep_last < len(full) else []:
        step = int(STEP_RE.match(ck.name).group(1))
        if export_every > 0 and step % export_every == 0:
            names = [n for n in (*EXPORT_FILES, CONFIG_FILE) if (ck / n).is_file()]
            try:
                manifest.keep(ck, names)  # the digests recorded at its save, never re-hashed: damage stays seen
            except BadInput:
                pass  # a manifest that does not read is left as it is: `dflash eval` says what is wrong with it
            (ck / STATE_FILE).unlink()
            stripped.append(ck.name)
        else:
            gone = ck.with_name(f".{ck.name}.deleting-{os.getpid()}")
            os.rename(ck, gone)
            shutil.rmtree(gone)
            removed.append(ck.name)
    return Pruned(tuple(removed), tuple(stripped))


def clean_leftovers(run_dir: Path) -> list[str]:
    """Remove what killed saves and removals left in RUN/checkpoints; returns the names removed.
    Call only while holding the run's lock (no other trainer writes there then)."""
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return []
    out = []
    for p in sorted(ckdir.iterdir()):
        if STAGE_RE.match(p.name) or DELETING_RE.match(p.name):
            if p.is_symlink():  # not a save's: the link goes (rmtree refuses links), never what it points at
                p.unlink(missing_ok=True)
            else:
                shutil.rmtree(p, ignore_errors=True)
            out.append(p.name)
        elif _TMP_RE.match(p.name) and p.is_file():
            p.unlink(missing_ok=True)
            out.append(p.name)
    return out
