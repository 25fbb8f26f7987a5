"""Who made an archive: the signed statement `cache save` writes, and the verdict `load`/`verify` act on.

An archive is code (docs/security.md): loading one is trusting whoever made it. So the first question
about an archive is its provenance, answered as one of three verdicts:

- `own`: signed by this machine's signing key (`keys.signing_key`): it was made here.
- `trusted`: signed by a key in the user's trust store (`compilewatch cache trust add`).
- `foreign`: anything else: no signature, a key nobody here trusts, a signature that does not verify,
  or content that differs from what was signed; also an archive signed by this machine's key or a
  trusted one when the key file or the trust store is one others can change (`keys.who_signed`,
  `modes.check`): the reason names the path and the fix. A foreign archive is loaded only with an explicit
  `--trust` (`trust=True`), and then as code from a stranger.

What is signed. `cache save` hashes every member with SHA-256 as it writes it (xxh3, the fingerprint's
hash, is fast but not collision resistant, so it cannot carry a signature) and writes last a member
`signature.json`: `{"statement": "<JSON text>", "public_key": base64, "signature": base64}`, the
Ed25519 signature over the statement's exact bytes. The statement names every member (`cache/...`,
the header, the Mega-Cache, the manifest) with its size and SHA-256, and says who made it (user,
host, key id: claims that mean something only when the signature verifies).

`archive.reader.check_provenance(archive)` reads the whole archive once, hashing every member, and returns a frozen
`Provenance`. (A directory `cache load` restores has no signature: `backups.judge` gives it the same
verdicts, `own` meaning a backup compilewatch recorded making here.) Nothing in it runs code; members are hashed, not parsed. Whoever uses the archive's
bytes afterwards (extraction, the Mega-Cache preload, a remote-cache push) checks each member
against `Provenance.member_sha256` as it reads it (`Provenance.check_member`), because the file may
change between the check and the use. `Provenance.require()` is the gate: BadInput for a foreign
archive unless it was checked with `trust=True`.
"""

from __future__ import annotations

import base64
import binascii
import getpass
import hashlib
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from compilewatch.cache.trust import keys
from compilewatch.errors import BadInput
from compilewatch.inputs import one_line

SIGNATURE = "signature.json"


STATEMENT_FORMAT = 1


CODE_WARNING = ("this archive is code: torch runs the Python, C++ and kernels its entries carry, as you, "
                "on the next compile")


Verdict = Literal["own", "trusted", "foreign"]


class SignedMembers(Mapping[str, str]):
    """Member name -> the SHA-256 that was signed. Read-only; in JSON it is its count, not a copy of
    every member's hash (a large cache has a million)."""

    __slots__ = ("_d",)

    def __init__(self, d: Mapping[str, str] | None = None) -> None:
        self._d = dict(d or {})

    def __getitem__(self, key: str) -> str:
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __str__(self) -> str:
        return f"{len(self._d)} signed members"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class Provenance:
    archive: str
    verdict: Verdict
    reason: str  # one plain sentence: why this verdict
    signed: bool  # a signature.json member was there
    key_id: str | None  # the key whose signature verified (None: none did)
    key_name: str | None  # "this machine" (keys.own_name), or the trust store's name for the key
    made_by: dict[str, Any]  # the statement's user / host / created_at (checked only when signed)
    trusted_by_flag: bool  # foreign, accepted because the caller passed trust=True
    member_sha256: SignedMembers = field(default_factory=SignedMembers)  # what was signed (own/trusted)
    kind: Literal["archive", "dir"] = "archive"  # "dir": a directory `cache load` restores (backups.judge)

    @property
    def allowed(self) -> bool:
        """May this archive be used: own or trusted, or foreign accepted with trust=True."""
        return self.verdict != "foreign" or self.trusted_by_flag

    @property
    def summary(self) -> str:
        """The first thing to say about the archive, in plain words."""
        if self.verdict == "own":
            if self.kind == "dir":
                return f"made here: {self.reason}"
            if self.key_name in (None, keys.MACHINE):
                return f"made here: signed by this machine's key {self.key_id}"
            # a key from COMPILEWATCH_SIGNING_KEY: yours, but any machine that holds it may have signed
            return f"signed by your own key: {keys.describe_own(str(self.key_id), self.key_name)}"
        if self.verdict == "trusted":
            return f"signed by a trusted key: {self.key_name} ({self.key_id})"
        return f"foreign: {self.reason}"

    def require(self) -> "Provenance":
        """Self, or BadInput when the archive is foreign and was not accepted with trust=True."""
        if self.allowed:
            return self
        if self.kind == "dir":
            raise BadInput(f"{self.archive} is foreign ({self.reason}); refused: a cache dir is code, and torch "
                           "runs what its entries carry",
                           hint="restore only backups compilewatch made here (`cache clear`, or the previous cache "
                                "a `cache load` moved aside). If you do trust whoever made this dir, pass --trust "
                                "to restore it once as code from a stranger, or `cache save` it where it was made "
                                "and load the signed archive (docs/security.md); nothing was changed")
        raise BadInput(f"{self.archive} is foreign ({self.reason}); refused: an archive is code, and "
                       "loading it runs what it carries",
                       hint="load only archives from machines and people you trust. If you do trust who made "
                            "it, add their key (`compilewatch cache trust add`), or pass --trust to load it "
                            "once as code from a stranger (docs/security.md); nothing was changed")

    def check_member(self, name: str, sha256_hex: str) -> None:
        """BadInput unless member `name` hashes as signed (no-op for a foreign archive: nothing was signed)."""
        if self.verdict == "foreign":
            return
        want = self.member_sha256.get(name)
        if want != sha256_hex:
            what = "is not in what was signed" if want is None else "differs from what was signed"
            raise BadInput(f"{self.archive}: member {one_line(name, 200)} {what}: the archive changed after it "
                           "was checked (or was altered); nothing was changed",
                           hint="check it again with `compilewatch cache verify ARCHIVE`")


# --- writing --------------------------------------------------------------------------------------
class Recorder:
    """Collects (member, size, SHA-256) as `cache save` writes them, then signs the statement."""

    def __init__(self) -> None:
        self.members: dict[str, list] = {}
        self._private = keys.signing_key(create=True)  # first: a key problem fails before anything is written
        self.key_id = keys.key_id(keys._raw_public(self._private))

    def add(self, name: str, size: int, sha256_hex: str) -> None:
        self.members[name] = [size, sha256_hex]

    def add_bytes(self, name: str, data: bytes) -> None:
        self.add(name, len(data), hashlib.sha256(data).hexdigest())

    def signature_member(self, created_at: str | None = None) -> bytes:
        """The `signature.json` bytes: the statement and its Ed25519 signature by `keys.signing_key()`."""
        private = self._private
        raw = keys._raw_public(private)
        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001
            user = None
        statement = json.dumps({
            "format": STATEMENT_FORMAT,
            "created_at": created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "made_by": {"user": user, "host": socket.gethostname(), "key_id": keys.key_id(raw)},
            "members": self.members,
        }, sort_keys=True, separators=(",", ":")).encode()
        return json.dumps({
            "statement": statement.decode(),
            "public_key": base64.b64encode(raw).decode(),
            "signature": base64.b64encode(private.sign(statement)).decode(),
        }).encode()


# --- checking -------------------------------------------------------------------------------------
def _verify_signature(data: bytes) -> tuple[bytes | None, dict | None, str]:
    """(raw public key, statement, problem) of a signature member; the statement only when the
    signature verifies."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        outer = json.loads(data)
        statement = outer["statement"].encode()
        raw = base64.b64decode(outer["public_key"], validate=True)
        sig = base64.b64decode(outer["signature"], validate=True)
        if len(raw) != 32:
            raise ValueError("not a 32-byte key")
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error, RecursionError):
        return None, None, "its signature member is malformed"
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(sig, statement)
    except (InvalidSignature, ValueError):
        return raw, None, f"its signature by key {keys.key_id(raw)} does not verify (the archive was altered after signing)"
    try:
        st = json.loads(statement)
        members = st["members"]
        if not (isinstance(st, dict) and isinstance(members, dict)
                and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
                        for v in members.values())):
            raise ValueError
    except (ValueError, KeyError, TypeError, RecursionError):
        return raw, None, "its signed statement is malformed"
    return raw, st, ""


def _made_by(st: dict | None) -> dict[str, Any]:
    if not st:
        return {}
    made = st.get("made_by") if isinstance(st.get("made_by"), dict) else {}
    return {k: one_line(made.get(k), 120) for k in ("user", "host") if isinstance(made.get(k), str)} | (
        {"created_at": one_line(st["created_at"], 40)} if isinstance(st.get("created_at"), str) else {})


def judge(archive: Path, seen: dict[str, tuple[int, str]], sig: bytes | None, trust: bool) -> Provenance:
    def foreign(reason: str, signed: bool, made: dict | None = None) -> Provenance:
        return Provenance(str(archive), "foreign", reason, signed, None, None, made or {}, trust)

    if sig is None:
        return foreign("it is not signed (made by an older compilewatch, or by someone else)", False)
    raw, st, problem = _verify_signature(sig)
    if st is None:
        return foreign(problem, True)
    made = _made_by(st)
    signer = keys.who_signed(raw)
    if not signer.trusted:
        host = f" ({made['user']}@{made['host']}, unverified)" if {"user", "host"} <= set(made) else ""
        kid = keys.key_id(raw)
        if signer.kind == "own":
            why = f"signed by {keys.describe_own(kid, signer.name)}, but that key cannot be trusted: {signer.problem}"
        elif signer.kind == "trusted":
            why = f"signed by key {kid}, named {signer.name!r} in your trust store, but that store cannot be trusted: {signer.problem}"
        elif signer.problem:
            why = f"signed by key {kid}{host}, which could not be checked against your keys: {signer.problem}"
        else:
            why = f"signed by key {kid}{host}, which is not in your trust store"
        return foreign(why, True, made)
    who = (signer.kind, signer.name)
    signed = {n: (v[0], v[1]) for n, v in st["members"].items()}
    missing = sorted(set(signed) - set(seen))
    extra = sorted(set(seen) - set(signed))
    changed = sorted(n for n in set(signed) & set(seen) if signed[n] != seen[n])
    if missing or extra or changed:
        bad = [one_line(x, 120) for x in (changed + extra + missing)[:3]]
        return foreign(f"signed by {who[1]} ({keys.key_id(raw)}), but its content differs from what was signed "
                       f"({len(changed)} changed, {len(extra)} added, {len(missing)} missing members, e.g. "
                       f"{', '.join(bad)})", True, made)
    kind, name = who
    reason = ("signed by this machine's key" if name == keys.MACHINE else f"signed by your own key, from {name}") \
        if kind == "own" else f"signed by {name}, a key in your trust store"
    return Provenance(str(archive), kind, reason, True, keys.key_id(raw), name, made, False,
                      SignedMembers({n: v[1] for n, v in signed.items()}))
