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

The config dir is `COMPILEWATCH_CONFIG_DIR`, else `$XDG_CONFIG_HOME/compilewatch`, else
`~/.config/compilewatch`. A public key travels as one line, `compilewatch-ed25519 <base64> <name>`
(`cache trust key` prints this machine's); its id is `ed25519:` + the first 24 hex digits of the
SHA-256 of the raw 32-byte key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from compilewatch.errors import BadInput
from compilewatch.fsutil import atomic_path
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
class TrustStore:
    path: str
    keys: tuple[TrustedKey, ...]
    own: PublicKey | None  # this machine's key (None: no archive was saved here yet)


def config_dir() -> Path:
    env = os.environ.get("COMPILEWATCH_CONFIG_DIR")
    if env:
        return Path(os.path.abspath(os.path.expanduser(env)))
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "compilewatch"


def key_path() -> Path:
    env = os.environ.get("COMPILEWATCH_SIGNING_KEY")
    return Path(os.path.abspath(os.path.expanduser(env))) if env else config_dir() / KEY_FILE


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


def _load_private(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    st = os.stat(path)
    if st.st_mode & 0o077:
        raise BadInput(f"signing key {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o})",
                       hint=f"chmod 600 {path}; whoever can read it can sign archives as you")
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


def _create_private(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    `create` and the default path is used (a named key file must exist). None when absent and not made."""
    path = key_path()
    if path.exists():
        return _load_private(path)
    if os.environ.get("COMPILEWATCH_SIGNING_KEY"):
        raise BadInput(f"COMPILEWATCH_SIGNING_KEY names {path}, which does not exist",
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


def _read_trusted() -> list[TrustedKey]:
    path = trust_path()
    if not path.exists():
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
        pk = parse_public_key(k["public_key"], name=k["name"])
        out.append(TrustedKey(pk.id, pk.public_key, pk.name, k["added_at"]))
    return out


def _write_trusted(keys: list[TrustedKey]) -> None:
    path = trust_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"keys": [
            {"id": k.id, "public_key": k.public_key, "name": k.name, "added_at": k.added_at} for k in keys]}, indent=2) + "\n")


def trust_store() -> TrustStore:
    """The keys this user trusts, and this machine's own (which is always trusted)."""
    return TrustStore(str(trust_path()), tuple(_read_trusted()), own_public_key(create=False))


def trust_add(key: str, *, name: str | None = None) -> TrustedKey:
    """Trust a public key: its one-line form, or a file holding it. Adding a key already there
    renames it; a name already used by another key is BadInput."""
    text = key
    if "\n" not in key and os.path.isfile(os.path.expanduser(key)):
        text = read_bytes(os.path.expanduser(key), limit=_MAX_KEY_FILE, what="public key file").decode("utf-8", "replace")
    pk = parse_public_key(text, name=name)
    keys = _read_trusted()
    if any(k.name == pk.name and k.id != pk.id for k in keys):
        raise BadInput(f"another trusted key is already named {pk.name!r}",
                       hint="choose another name with --name, or remove that key first")
    added = TrustedKey(pk.id, pk.public_key, pk.name, datetime.now(timezone.utc).isoformat(timespec="seconds"))
    keys = [k for k in keys if k.id != pk.id] + [added]
    _write_trusted(keys)
    return added


def trust_remove(which: str) -> TrustedKey:
    """Stop trusting the key with this id (or a unique id prefix) or name."""
    keys = _read_trusted()
    hits = [k for k in keys if which in (k.id, k.name) or (len(which) >= 12 and k.id.startswith(which))]
    if len(hits) != 1:
        listed = ", ".join(f"{k.name} ({k.id})" for k in keys) or "none"
        raise BadInput(f"{'no' if not hits else 'more than one'} trusted key matches {one_line(which, 80)!r}",
                       hint=f"trusted keys: {listed} (`compilewatch cache trust list`)")
    _write_trusted([k for k in keys if k is not hits[0]])
    return hits[0]


def trusted_by_raw(raw: bytes) -> tuple[str, str] | None:
    """("own" | "trusted", name) for a raw public key this user trusts, else None."""
    kid = key_id(raw)
    own = own_public_key(create=False)
    if own is not None and own.id == kid and base64.b64decode(own.public_key) == raw:
        return "own", "this machine"
    for k in _read_trusted():
        if k.id == kid and base64.b64decode(k.public_key) == raw:
            return "trusted", k.name
    return None
