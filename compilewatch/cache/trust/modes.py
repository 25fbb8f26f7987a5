"""Who else could change a file compilewatch trusts: the ownership and mode check (like OpenSSH's StrictModes).

compilewatch believes four things because they sit in the user's own config dir: the signing key
(an archive it signed was made here), the trust store (an archive a key in it signed loads), the
record of backups (a dir it names restores) and the config dir that holds them. Each is only worth
believing if nobody but the user (or root) can change it, or the folders above it. `check` is the
one test, used by `keys` and `backups` before they read or write any of them:

- the file (or dir) itself: a regular file (a dir for a dir), owned by the user or root, not
  writable by group or others; a private file (the signing key) not readable by them either;
- every directory the path is looked up in, from `/` down, symbolic links followed the way the
  kernel follows them (the directories a link's target is looked up in are checked too): owned by
  the user or root and not writable by group or others, except a root-owned sticky dir (`/tmp`,
  mode 1777): there others may add names but cannot rename or remove the user's, so what the user
  made in it stays the user's (a name someone else made there is owned by them, and refused);
- every symbolic link followed: owned by the user or root (a link another user owns, in a sticky
  dir, is one they can point elsewhere).

Group-writable is accepted where the group is the owner's alone (a user-private group, what a umask
of 002 on Debian and Ubuntu gives every new folder): exactly one member, the owner, counting both
primary and supplementary members, as Debian's OpenSSH decides it (`secure_permissions`).

OpenSSH refuses any group- or world-writable ancestor; the sticky exception is what lets a config
dir live under `/tmp` (CI jobs, tests) without letting anyone else change it. A path that does not
exist yet passes when the folders that do exist pass: what is created later is created by the user.
The check reads no file content; reading stays with `compilewatch.inputs`' bounded readers. Where
there is no notion of a user id (no `os.getuid`) nothing is checked.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from compilewatch.errors import BadInput
from compilewatch.inputs import file_kind

_MAX_LINKS = 40  # the kernel's own limit (ELOOP)
ROOT = 0

Kind = Literal["type", "owner", "mode", "access"]


@dataclass(frozen=True, slots=True)
class Problem:
    """Why `subject` (a `what`) cannot be trusted: `path` (it, or a folder or link on the way to it) `why`."""

    what: str  # "trust store", "signing key", ...
    subject: str  # the path that was checked
    path: str  # the path that is wrong: the subject, a folder above it, or a link on the way
    why: str  # "is writable by group and others (mode 777)"
    fix: str  # "chmod 700 /x"
    kind: Kind

    @property
    def message(self) -> str:
        if self.path == self.subject:
            return f"{self.what} {self.subject} {self.why}"
        return f"{self.what} {self.subject} is not safe: {self.path} {self.why}"

    @property
    def sentence(self) -> str:
        """The message and its fix, for a verdict's reason."""
        return f"{self.message} (fix: {self.fix})"

    def error(self, refused: str = "") -> BadInput:
        """BadInput naming the path and the fix; `refused`: what was not done, appended to the message."""
        why = ("anyone who can change it could make compilewatch trust what they wrote" if self.kind in ("owner", "mode")
               else "compilewatch reads it only as a plain file")
        e = BadInput(self.message + (f"; {refused}" if refused else ""),
                     hint=f"{self.fix}; {why} (the ownership and mode rule of docs/security.md)")
        e.problem = self  # type: ignore[attr-defined]
        return e


@functools.lru_cache(maxsize=64)
def _private_group(gid: int, owner: int) -> bool:
    """Is group `gid` the owner's alone: one member, `owner` (primary or supplementary; Debian's OpenSSH)."""
    try:
        import grp
        import pwd

        gr = grp.getgrgid(gid)
        owner_name = pwd.getpwuid(owner).pw_name
        members = 0
        for pw in pwd.getpwall():
            if pw.pw_gid == gid:
                members += 1
                if pw.pw_uid != owner:
                    return False
        if gr.gr_mem:
            members += 1
            if gr.gr_mem != [owner_name]:
                return False
        return members > 0
    except (ImportError, KeyError, OSError):
        return False


def _others_write(s: os.stat_result) -> int:
    """The write bits of `s` that let someone other than its owner (and root) write to it."""
    bits = stat.S_IMODE(s.st_mode) & 0o022
    if bits & stat.S_IWGRP and _private_group(s.st_gid, s.st_uid):
        bits &= ~stat.S_IWGRP
    return bits


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _owner_words(uid: int) -> str:
    name = _user(uid)
    return f"uid {uid} ({name})" if name != str(uid) else f"uid {uid}"


def _walk(path: str) -> tuple[list[tuple[str, os.stat_result]], list[tuple[str, os.stat_result]], str,
                               os.stat_result | None]:
    """(every directory a name was looked up in, every symbolic link followed, the resolved path, its
    lstat or None when it does not exist). OSError for what cannot be looked at (ELOOP included);
    NotADirectoryError names the non-directory in its filename."""
    dirs: dict[str, os.stat_result] = {}
    links: list[tuple[str, os.stat_result]] = []
    todo = list(reversed(path.split("/")))
    cur = "/"
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            cur = os.path.dirname(cur)  # cur is resolved: this is the kernel's ".."
            continue
        if cur not in dirs:
            st = os.lstat(cur)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(20, "Not a directory", cur)
            dirs[cur] = st
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return list(dirs.items()), links, os.path.join(nxt, *reversed(todo)), None
        except NotADirectoryError:
            raise NotADirectoryError(20, "Not a directory", cur) from None
        if stat.S_ISLNK(st.st_mode):
            links.append((nxt, st))
            if len(links) > _MAX_LINKS:
                raise OSError(40, "Too many levels of symbolic links", nxt)
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            todo.extend(reversed(target.split("/")))
            continue
        cur = nxt
    return list(dirs.items()), links, cur, os.lstat(cur)


def check(path: str | os.PathLike[str], what: str, *, directory: bool = False, private: bool = False,
          base: str | os.PathLike[str] | None = None) -> Problem | None:
    """The first reason `path` (a `what`) cannot be trusted, or None (module docstring). `directory`:
    it must be a dir; `private`: not readable by group or others either (a key); `base`: the folder
    compilewatch keeps it in (the config dir): its own fix is `chmod 700`, a folder above it `chmod go-w`."""
    uid = _uid()
    if uid is None:
        return None
    subject = os.fspath(path)
    subject = subject if os.path.isabs(subject) else os.path.join(os.getcwd(), subject)
    shown = os.path.abspath(subject)
    own_base = os.path.abspath(base) if base is not None else None
    me = _user(uid)

    def problem(p: str, why: str, fix: str, kind: Kind) -> Problem:
        return Problem(what, shown, os.path.abspath(p), why, fix, kind)

    try:
        dirs, links, resolved, st = _walk(subject)
    except NotADirectoryError as e:
        p = str(e.filename)
        try:
            kind = file_kind(os.lstat(p).st_mode)
        except OSError:
            kind = "not a directory"
        return problem(p, f"is {kind}, not a directory", f"move {p} aside, or keep the config dir elsewhere", "type")
    except OSError as e:
        p = str(e.filename or subject)
        return problem(p, f"cannot be checked: {e.strerror or e}", f"make {p} readable by you", "access")

    def owner_problem(p: str, s: os.stat_result, link: bool = False) -> Problem | None:
        if s.st_uid in (uid, ROOT):
            return None
        mine = f"you ({me})" if uid != ROOT else "root"
        thing = "is a symbolic link owned by" if link else "is owned by"
        fix = f"remove {p} (its owner can point it elsewhere)" if link else f"chown {me} {p}"
        return problem(p, f"{thing} {_owner_words(s.st_uid)}, not by {mine}" + (" or root" if uid != ROOT else ""),
                       fix, "owner")

    def dir_mode(p: str) -> str:
        inside = own_base is not None and (p == own_base or p.startswith(own_base.rstrip("/") + "/"))
        return f"chmod 700 {p}" if inside else f"chmod go-w {p}"

    for d, s in dirs:
        bad = owner_problem(d, s)
        if bad is not None:
            return bad
        if _others_write(s) and not (s.st_uid == ROOT and s.st_mode & stat.S_ISVTX):
            note = ("; a folder others may write to is accepted only when root owns it and it is sticky, like /tmp"
                    if s.st_mode & stat.S_ISVTX else "")
            return problem(d, f"is writable by {_writers(_others_write(s))} (mode {stat.S_IMODE(s.st_mode):o}{note})",
                           dir_mode(d), "mode")
    for link, s in links:
        bad = owner_problem(link, s, link=True)
        if bad is not None:
            return bad
    if st is None:
        return None
    via = f" ({resolved}, through a symbolic link)" if links and resolved != shown else ""
    if directory and not stat.S_ISDIR(st.st_mode):
        return problem(shown, f"is {file_kind(st.st_mode)}{via}, not a directory",
                       f"move {shown} aside (a directory is made in its place)", "type")
    if not directory and not stat.S_ISREG(st.st_mode):
        return problem(shown, f"is {file_kind(st.st_mode)}{via}, not a regular file",
                       f"move {shown} aside" + (" (a new one is made in its place)" if what != "signing key" else ""),
                       "type")
    bad = owner_problem(resolved, st)
    if bad is not None:
        return bad
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o077:
        verb = "readable" if mode & 0o044 else "writable" if mode & 0o022 else "usable"
        return problem(resolved, f"is {verb} by other users (mode {mode:o})", f"chmod 600 {resolved}", "mode")
    if _others_write(st):
        return problem(resolved, f"is writable by {_writers(_others_write(st))} (mode {mode:o})",
                       dir_mode(resolved) if directory else f"chmod 600 {resolved}", "mode")
    return None


def _writers(mode: int) -> str:
    g, o = mode & stat.S_IWGRP, mode & stat.S_IWOTH
    return "group and others" if g and o else "its group" if g else "others"


def require(path: str | os.PathLike[str], what: str, *, refused: str = "", **kw) -> None:
    """BadInput (exit 2) naming the path and the fix when `check` finds a problem."""
    bad = check(path, what, **kw)
    if bad is not None:
        raise bad.error(refused)


def ensure_dir(path: str | os.PathLike[str], what: str = "config dir", *, refused: str = "") -> Path:
    """`path` as a directory that passes `check`: the folders above it checked first, then what is
    missing made mode 0700 (not the umask's mode), then checked again. BadInput naming the path and
    the fix otherwise: nothing is written into a folder others can change."""
    p = Path(os.path.abspath(path))
    require(p, what, directory=True, base=p, refused=refused)
    missing = []
    q = p
    while not os.path.lexists(q):
        missing.append(q)
        q = q.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)  # mkdir's mode is masked by the umask (never widened, but say what we mean)
        except FileExistsError:
            pass
        except OSError as e:
            raise BadInput(f"{what} {p} cannot be made: {d}: {e.strerror or e}",
                           hint=f"make it yourself (mkdir -m 700 {p}), or set COMPILEWATCH_CONFIG_DIR "
                                "to a folder of your own") from None
    require(p, what, directory=True, base=p, refused=refused)
    return p
