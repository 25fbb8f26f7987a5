"""Signing keys: this machine's own key, and the trust store of keys whose archives the user accepts.

An archive is code (docs/security.md), so whether to load one is decided by who made it. `cache save`
signs every archive with Ed25519 (through `cryptography`, the Python Cryptographic Authority's
library: OpenSSL's Ed25519 underneath, maintained, in most Python environments already):

- **The machine key** (`signing_key()`): a per-user private key, created on the first save as
  `<config dir>/signing-key.pem`, mode 0600, in a 0700 folder. Archives it signed are recognised as
  "made here" with no extra step. `COMPILEWATCH_SIGNING_KEY=FILE` signs with another key file instead
  (a CI or cluster key kept in a secret store); a key file readable by others is refused, as ssh does.
- **The trust store** (`<config dir>/trusted-keys.json`): the public keys of other machines and people
  whose archives load without `--trust` (`compilewatch cache trust add/list/remove`). Nothing is ever
  added to it implicitly.

Each is believed only where nobody else can change it (`modes.check`, like ssh's StrictModes): the
key file, the trust store, the config dir and every folder above them owned by the user or root and
not writable by group or others (a root-owned sticky dir such as /tmp excepted); the key not
readable by others either. Otherwise a key is not made there (`signing_key`: BadInput naming the
path and the fix), and an archive it would vouch for is foreign with that reason (`who_signed`).

The config dir is `COMPILEWATCH_CONFIG_DIR`, else `$XDG_CONFIG_HOME/compilewatch`, else
`~/.config/compilewatch`. A public key travels as one line, `compilewatch-ed25519 <base64> <name>`
(`cache trust key` prints this machine's); its id is `ed25519:` + the first 24 hex digits of the
SHA-256 of the raw 32-byte key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from compilewatch.cache.trust import modes
from compilewatch.errors import BadInput
from compilewatch.fsutil import write_failed
from compilewatch.inputs import loads_json, one_line, read_bytes

KEY_TYPE = "compilewatch-ed25519"
KEY_FILE = "signing-key.pem"
TRUST_FILE = "trusted-keys.json"
_MAX_KEY_FILE = 64 << 10
_MAX_TRUST_FILE = 4 << 20
_NAME = re.compile(r"^[A-Za-z0-9@._:+-]{1,64}$")


@dataclass(frozen=True, slots=True)
class PublicKey:
    id: str  # "ed25519:<24 hex digits>"
    public_key: str  # base64 of the raw 32 bytes
    name: str  # who it belongs to (as whoever shared or added it said)


@dataclass(frozen=True, slots=True)
class TrustedKey:
    id: str
    public_key: str
    name: str
    added_at: str


@dataclass(frozen=True, slots=True)
class Signer:
    """Who signed, as far as this user's keys tell: `kind` "own" / "trusted" with the key's `name` when
    it is this machine's key or in the trust store; `problem`: why that cannot be believed now (the
    file that says so is one others can change, or cannot be read). Trusted only when `trusted`."""

    kind: Literal["own", "trusted"] | None
    name: str | None
    problem: str | None = None

    @property
    def trusted(self) -> bool:
        return self.kind is not None and self.problem is None


@dataclass(frozen=True, slots=True)
class TrustStore:
    path: str
    keys: tuple[TrustedKey, ...]
    own: PublicKey | None  # this machine's key (None: no archive was saved here yet)
    own_name: str = "this machine"  # whose `own` is (`own_name()`: this machine, or COMPILEWATCH_SIGNING_KEY's file)
    # what is odd in the store, one sentence each: a key listed under two names, two keys under one
    # name, this machine's own key listed (a hand-edited store: `trust add` makes none of these)
    notes: tuple[str, ...] = ()


def config_dir() -> Path:
    env = os.environ.get("COMPILEWATCH_CONFIG_DIR")
    if env:
        return Path(os.path.abspath(os.path.expanduser(env)))
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "compilewatch"


ENV_KEY = "COMPILEWATCH_SIGNING_KEY"


MACHINE = "this machine"  # the name of the config dir's own key (`own_name`)


def key_path() -> Path:
    env = os.environ.get(ENV_KEY)
    return Path(os.path.abspath(os.path.expanduser(env))) if env else config_dir() / KEY_FILE


def own_name() -> str:
    """Whose key `signing_key()` is, in words: MACHINE ("this machine": the config dir's key), or
    "COMPILEWATCH_SIGNING_KEY (PATH)" when that variable names another key file (a CI or cluster
    key: archives it signs may have been made on any machine that holds it)."""
    return f"{ENV_KEY} ({key_path()})" if os.environ.get(ENV_KEY) else MACHINE


def describe_own(kid: str, name: str | None = None) -> str:
    """`kid`, the signing key `own_name()` (or `name`) says, in words: "this machine's key ID", or
    "key ID from COMPILEWATCH_SIGNING_KEY (PATH)"."""
    name = own_name() if name is None else name
    return f"this machine's key {kid}" if name == MACHINE else f"key {kid} from {name}"


def key_id(raw: bytes) -> str:
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:24]


def _raw_public(private) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _default_name() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container without /etc/passwd entry)
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    name = f"{user}@{socket.gethostname()}"
    return re.sub(r"[^A-Za-z0-9@._:+-]", "_", name)[:64] or "unnamed"


def _dangling(path: Path, what: str) -> BadInput:
    return BadInput(f"{what} {path} is a symbolic link to {one_line(os.readlink(path), 200)}, which does not exist",
                    hint=f"remove the link ({path}) or make it point at the file")


def _parse_private(path: Path):
    """The Ed25519 key in `path`, read with the bounded reader; no ownership check (the caller's)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not path.exists() and path.is_symlink():
        raise _dangling(path, "signing key")
    data = read_bytes(path, limit=_MAX_KEY_FILE, what="signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise BadInput(f"signing key {path} is not an unencrypted PEM private key ({one_line(e, 120)})",
                       hint="remove it to have a new one made on the next `cache save`, or point "
                            "COMPILEWATCH_SIGNING_KEY at the right file") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadInput(f"signing key {path} is not an Ed25519 key")
    return key


def _key_problem(path: Path) -> modes.Problem | None:
    return modes.check(path, "signing key", private=True, base=config_dir())


def _load_private(path: Path):
    """The key in `path`, BadInput unless nobody else can read or change it (`modes.check`)."""
    bad = _key_problem(path)
    if bad is not None:
        raise bad.error("it is not used (whoever can read or replace it can sign archives as you)")
    return _parse_private(path)


def _create_private(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    modes.ensure_dir(path.parent, refused="no signing key was made there")  # never a key in a folder others can change
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # never replaces a key another process made meanwhile
        except FileExistsError:
            return _load_private(path)
    finally:
        tmp.unlink(missing_ok=True)
    return key


def signing_key(*, create: bool = True):
    """This machine's (or COMPILEWATCH_SIGNING_KEY's) Ed25519 private key; made on first use when
    `create` and the default path is used (a named key file must exist). None when absent and not made.
    BadInput (naming the path and the fix) for a key, or a folder above it, that others can change or
    read, and for a config dir others can change when a key would be made in it."""
    path = key_path()
    if os.path.lexists(path):
        return _load_private(path)
    if os.environ.get(ENV_KEY):
        raise BadInput(f"{ENV_KEY} names {path}, which does not exist",
                       hint="point it at an Ed25519 PEM key file, or unset it to use this machine's key")
    return _create_private(path) if create else None


def own_public_key(*, create: bool = False) -> PublicKey | None:
    key = signing_key(create=create)
    if key is None:
        return None
    raw = _raw_public(key)
    return PublicKey(key_id(raw), base64.b64encode(raw).decode(), _default_name())


def public_key_line(pk: PublicKey) -> str:
    """The one line that shares a public key: `compilewatch-ed25519 <base64> <name>`."""
    return f"{KEY_TYPE} {pk.public_key} {pk.name}"


def parse_public_key(text: str, *, name: str | None = None) -> PublicKey:
    """A public key from its one-line form (or the bare base64); BadInput for anything else."""
    fields = text.strip().split()
    if fields and fields[0] == KEY_TYPE:
        fields = fields[1:]
    if not fields:
        raise BadInput("no public key given", hint=f"pass the line `{KEY_TYPE} <base64> <name>` that "
                                                   "`compilewatch cache trust key` prints on the other machine")
    try:
        raw = base64.b64decode(fields[0], validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise BadInput(f"not an Ed25519 public key: {one_line(fields[0], 60)!r}",
                       hint=f"expected `{KEY_TYPE} <base64 of 32 bytes> <name>`")
    chosen = name or (fields[1] if len(fields) > 1 else None) or key_id(raw)
    if not _NAME.match(chosen):
        raise BadInput(f"key name {one_line(chosen, 80)!r} is not 1-64 letters, digits or @._:+-")
    return PublicKey(key_id(raw), base64.b64encode(raw).decode(), chosen)


# --- trust store ----------------------------------------------------------------------------------
def trust_path() -> Path:
    return config_dir() / TRUST_FILE


def _store_problem() -> modes.Problem | None:
    return modes.check(trust_path(), "trust store", base=config_dir())


def _read_trusted(*, checked: bool = True) -> list[TrustedKey]:
    """The trust store's keys; `checked`: BadInput first when others can change it (`modes.check`)."""
    path = trust_path()
    if checked:
        bad = _store_problem()
        if bad is not None:
            raise bad.error("its keys are not trusted")
    if not path.exists():
        if path.is_symlink():
            raise _dangling(path, "trust store")
        return []
    data = loads_json(read_bytes(path, limit=_MAX_TRUST_FILE, what="trust store"), str(path))
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, list):
        raise BadInput(f"{path} is not a compilewatch trust store (no \"keys\" list)",
                       hint="move it aside and add the keys again with `compilewatch cache trust add`")
    out = []
    for i, k in enumerate(keys):
        if not (isinstance(k, dict) and all(isinstance(k.get(f), str) for f in ("id", "public_key", "name", "added_at"))):
            raise BadInput(f"{path}: keys[{i}] is not an object with id, public_key, name, added_at strings")
        try:
            pk = parse_public_key(k["public_key"], name=k["name"])
        except BadInput as e:  # a hand-edited entry: say which, in which file
            raise BadInput(f"{path}: keys[{i}] ({one_line(k['name'], 64)!r}): {e.message}",
                           hint=f"fix or remove that entry in {path} (`compilewatch cache trust add` writes only "
                                "valid ones); until then no key in it is trusted") from None
        out.append(TrustedKey(pk.id, pk.public_key, pk.name, k["added_at"]))
    return out


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, mode 0600 whatever the umask (a file `modes.check` accepts), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_failed(path, e) from None


def _write_trusted(keys: list[TrustedKey]) -> None:
    path = trust_path()
    modes.ensure_dir(path.parent, refused="the trust store was not changed")
    write_private(path, (json.dumps({"keys": [
        {"id": k.id, "public_key": k.public_key, "name": k.name, "added_at": k.added_at} for k in keys]}, indent=2) + "\n").encode())


def trust_store() -> TrustStore:
    """The keys this user trusts, and this machine's own (which is always trusted), with `notes` on
    what `trust add` never makes (a hand-edited or merged store)."""
    listed = tuple(_read_trusted())
    own = own_public_key(create=False)
    return TrustStore(str(trust_path()), listed, own, own_name(), _store_notes(listed, own))


def _store_notes(listed: tuple[TrustedKey, ...], own: PublicKey | None) -> tuple[str, ...]:
    names: dict[str, list[str]] = {}
    ids: dict[str, list[str]] = {}
    for k in listed:
        names.setdefault(k.id, []).append(k.name)
        ids.setdefault(k.name, []).append(k.id)
    notes = []
    for kid, ns in names.items():
        if len(ns) > 1:
            shown = ", ".join(repr(n) for n in dict.fromkeys(ns))
            notes.append(f"key {kid} is trusted under {len(ns)} names ({shown}): one key has one name (archives it "
                         f"signs show the first, {ns[0]!r}); `cache trust remove {kid}` removes it under every name, "
                         "then add it once")
    for name, ks in ids.items():
        if len(set(ks)) > 1:
            notes.append(f"{len(set(ks))} different keys are named {name!r} ({', '.join(dict.fromkeys(ks))}): archives "
                         f"signed by any of them show {name!r}; remove the one you do not mean by its id")
    if own is not None and own.id in names:
        notes.append(f"this machine's own key {own.id} is also listed, as {', '.join(repr(n) for n in names[own.id])}: "
                     "its archives are recognised as made here all the same")
    return tuple(notes)


def trust_add(key: str, *, name: str | None = None) -> TrustedKey:
    """Trust a public key: its one-line form, or a file holding it. BadInput for this machine's own key
    (already trusted, as made here), for a key already trusted under another name (one key, one
    name), and for a name another key has; adding a key again under its own name changes nothing."""
    text = key
    path = os.path.expanduser(key)
    if "\n" not in key and not key.startswith(KEY_TYPE + " ") and os.path.lexists(path):
        # a file holding the line (read bounded; a directory or FIFO is refused by name, never waited on)
        text = read_bytes(path, limit=_MAX_KEY_FILE, what="public key file").decode("utf-8", "replace")
        if not text.strip():
            raise BadInput(f"public key file {path} is empty",
                           hint="it should hold the line `compilewatch cache trust key` printed on the other machine")
    pk = parse_public_key(text, name=name)
    keys = _read_trusted()
    own = own_public_key(create=False)
    if own is not None and own.id == pk.id:
        whose = f"this machine's own signing key ({key_path()}): its archives are already trusted, as made here" \
            if own_name() == MACHINE else f"your own signing key, from {own_name()}: its archives are already trusted"
        raise BadInput(f"key {pk.id} is {whose}; nothing was added",
                       hint="add the keys of other machines and people; give this one to them "
                            "(`compilewatch cache trust key`)")
    held = next((k for k in keys if k.id == pk.id), None)
    if held is not None:
        if held.name == pk.name:
            return held
        raise BadInput(f"key {pk.id} is already trusted, as {held.name!r}; nothing was added",
                       hint=f"one key has one name: to call it {pk.name!r}, `compilewatch cache trust remove "
                            f"{held.name}`, then add it again with --name {pk.name}")
    if any(k.name == pk.name for k in keys):
        raise BadInput(f"another trusted key is already named {pk.name!r}",
                       hint="choose another name with --name, or remove that key first")
    added = TrustedKey(pk.id, pk.public_key, pk.name, datetime.now(timezone.utc).isoformat(timespec="seconds"))
    _write_trusted([*keys, added])
    return added


def trust_remove(which: str) -> TrustedKey:
    """Stop trusting the key with this id (or a unique id prefix) or name."""
    keys = _read_trusted()
    hits = [k for k in keys if which in (k.id, k.name) or (len(which) >= 12 and k.id.startswith(which))]
    if len({k.id for k in hits}) != 1:
        listed = ", ".join(f"{k.name} ({k.id})" for k in keys) or "none"
        raise BadInput(f"{'no' if not hits else 'more than one'} trusted key matches {one_line(which, 80)!r}",
                       hint=f"trusted keys: {listed} (`compilewatch cache trust list`)")
    # the key, under every name a hand-written store gives it: removing one name must not leave it trusted
    _write_trusted([k for k in keys if k.id != hits[0].id])
    return hits[0]


def _why(e: BadInput) -> str:
    bad = getattr(e, "problem", None)
    return bad.sentence if isinstance(bad, modes.Problem) else e.message


def who_signed(raw: bytes) -> Signer:
    """What this user's keys say about the raw public key `raw` (`Signer`). Never raises for a bad
    setup: a key file or trust store that others can change still says whose key it is (read with
    the bounded readers, as data), and `problem` says why that cannot be believed; one that cannot
    be read (not a regular file, malformed) makes `problem` say the key could not be checked."""
    kid = key_id(raw)
    unknown: list[str] = []
    path = key_path()
    if os.path.lexists(path):
        bad = _key_problem(path)
        if bad is not None and bad.kind in ("type", "access"):
            unknown.append(bad.sentence)
        else:
            try:
                own_raw = _raw_public(_parse_private(path))
            except BadInput as e:
                unknown.append(f"this machine's key cannot be read: {_why(e)}")
            else:
                if own_raw == raw:
                    return Signer("own", own_name(), bad.sentence if bad is not None else None)
    bad = _store_problem()
    if bad is not None and bad.kind in ("type", "access"):
        unknown.append(bad.sentence)
    else:
        try:
            listed = _read_trusted(checked=False)
        except BadInput as e:
            unknown.append(f"the trust store cannot be read: {_why(e)}")
        else:
            for k in listed:
                if k.id == kid and base64.b64decode(k.public_key) == raw:
                    return Signer("trusted", k.name, bad.sentence if bad is not None else None)
    return Signer(None, None, "; ".join(unknown) or None)


def trusted_by_raw(raw: bytes) -> tuple[str, str] | None:
    """("own" | "trusted", name) for a raw public key this user trusts, else None (`who_signed`)."""
    who = who_signed(raw)
    return (who.kind, who.name) if who.trusted else None
