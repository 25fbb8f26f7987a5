"""Signatures of remote-cache entries: who wrote the value torch is about to unpickle.

A remote entry is code on every node that reads it (docs/security.md), and Redis says nothing about
who wrote a key. So every entry compilewatch writes (`cache remote push`, and torch's own writes from
a process compilewatch watches, `remote.verified`) gets a signature in a sibling key,
`keyspace.signature_key(K)` = `pt2:compilewatch-sig::K:c1`, and every read compilewatch makes on
torch's behalf checks it first.

The signature value is ASCII JSON, at most `MAX_SIGNATURE` bytes:

    {"format": "compilewatch-remote-sig", "version": 1, "key_id": "ed25519:<24 hex>",
     "public_key": "<base64 of the raw 32-byte Ed25519 key>", "sha256": "<hex of the value>",
     "signature": "<base64 of 64 bytes>"}

signed (Ed25519, `trust.keys.signing_key()`: this machine's key or COMPILEWATCH_SIGNING_KEY) over the
bytes `compilewatch-remote-sig v1\\n<Redis key>\\n<sha256 hex of the value>`. The key name is inside
what is signed, so a signed value copied under another key does not verify there. Verdicts:

| verdict | means | admitted |
|---|---|---|
| own | signed by this machine's key | yes |
| trusted | signed by a key in the trust store (`cache trust add`) | yes |
| unsigned | no signature key | no |
| foreign | a valid signature by a key nobody here trusts | no |
| bad-signature | a signature that does not verify, is for other bytes (the value changed after it was signed) or is not one | no |
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import threading
from dataclasses import dataclass

from compilewatch.cache.trust import keys as trust_keys
from compilewatch.errors import BadInput

FORMAT = "compilewatch-remote-sig"
VERSION = 1
MAX_SIGNATURE = 4096  # a real one is ~300 bytes
ADMITTED = ("own", "trusted")
REFUSED = ("unsigned", "foreign", "bad-signature")


def message(key: str, value: bytes) -> bytes:
    """The bytes a signature covers: the Redis key and the SHA-256 of the value."""
    return b"%s v%d\n%s\n%s" % (FORMAT.encode(), VERSION, key.encode("utf-8", "surrogateescape"),
                                hashlib.sha256(value).hexdigest().encode())


class Signer:
    """This machine's (or COMPILEWATCH_SIGNING_KEY's) key, loaded once."""

    def __init__(self, private) -> None:
        self._key = private
        self.raw = trust_keys._raw_public(private)
        self.key_id = trust_keys.key_id(self.raw)

    @classmethod
    def load(cls, *, create: bool = True) -> "Signer":
        """BadInput when the key cannot be used (readable by others, not Ed25519, a named file missing)."""
        key = trust_keys.signing_key(create=create)
        if key is None:
            raise BadInput("this machine has no signing key yet")
        return cls(key)

    def sign(self, key: str, value: bytes) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "key_id": self.key_id,
                           "public_key": base64.b64encode(self.raw).decode("ascii"),
                           "sha256": hashlib.sha256(value).hexdigest(),
                           "signature": base64.b64encode(self._key.sign(message(key, value))).decode("ascii")},
                          separators=(",", ":")).encode("ascii")


@dataclass(frozen=True, slots=True)
class Verdict:
    state: str  # own, trusted, unsigned, foreign, bad-signature
    signer: str | None  # who (this machine, a trusted key's name, a foreign key's id)
    detail: str

    @property
    def ok(self) -> bool:
        return self.state in ADMITTED


def _parse(sig: bytes) -> tuple[bytes, str, bytes] | str:
    """(raw public key, sha256 hex, signature) or why it is not a signature."""
    if len(sig) > MAX_SIGNATURE:
        return f"a {len(sig)} byte signature value (at most {MAX_SIGNATURE})"
    try:
        d = json.loads(sig)  # flat and at most 4 KiB: no depth to bound beyond the size
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "the signature key does not hold JSON"
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
        return "the signature key does not hold a compilewatch signature of this version"
    pub, digest, s = d.get("public_key"), d.get("sha256"), d.get("signature")
    if not (isinstance(pub, str) and isinstance(digest, str) and isinstance(s, str)):
        return "a signature without public_key, sha256 and signature strings"
    try:
        raw, sigbytes = base64.b64decode(pub, validate=True), base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        return "a signature whose key or signature is not base64"
    if len(raw) != 32 or len(sigbytes) != 64:
        return "a signature whose key or signature has the wrong length"
    return raw, digest, sigbytes


class Trust:
    """Whom this process trusts: `trust.keys.who_signed` (this machine's key, the trust store, each
    believed only where nobody else can change it), asked once per signing key and again when the key
    file or the trust store changes."""

    def __init__(self) -> None:
        self._known: dict[bytes, trust_keys.Signer] = {}
        self._stamp: tuple | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _files_stamp() -> tuple:
        out = []
        for p in (trust_keys.key_path(), trust_keys.trust_path()):
            try:
                st = os.lstat(p)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode, st.st_uid))
            except OSError:
                out.append(None)
        return tuple(out)

    def refresh(self) -> None:
        stamp = self._files_stamp()
        with self._lock:
            if stamp != self._stamp:
                self._stamp, self._known = stamp, {}

    def who(self, raw: bytes) -> "trust_keys.Signer":
        with self._lock:
            got = self._known.get(raw)
        if got is None:
            got = trust_keys.who_signed(raw)  # never raises for a bad setup: `problem` says why
            with self._lock:
                self._known[raw] = got
        return got

    def check(self, key: str, value: bytes, sig: bytes | None) -> Verdict:
        """The verdict on `value` read under Redis key `key`, with `sig` the signature key's value."""
        if sig is None:
            return Verdict("unsigned", None, "no signature: not written by `cache remote push` or a watched process")
        parsed = verifies(key, value, sig)
        if isinstance(parsed, Verdict):
            return parsed
        who = self.who(parsed)
        kid = trust_keys.key_id(parsed)
        if who.trusted:
            if who.kind == "own":  # the config dir's key, or COMPILEWATCH_SIGNING_KEY's (any machine holding it)
                name = trust_keys.own_name()
                return Verdict("own", name, f"signed by {trust_keys.describe_own(kid, name)}")
            return Verdict("trusted", who.name, f"signed by trusted key {who.name!r}")
        if who.kind is not None:
            return Verdict("foreign", who.name, f"signed by {who.name} ({kid}), but {who.problem}")
        return Verdict("foreign", kid, f"signed by {kid}, a key nobody here trusts (`cache trust add` trusts it)"
                       + (f"; {who.problem}" if who.problem else ""))

    @staticmethod
    def structurally_valid(key: str, value: bytes, sig: bytes) -> str | None:
        """None when `sig` is a signature of `value` under `key` by some key (trusted or not), else why not."""
        got = verifies(key, value, sig)
        return got.detail if isinstance(got, Verdict) else None


def verifies(key: str, value: bytes, sig: bytes) -> bytes | Verdict:
    """The raw public key that signed `value` under `key`, or a bad-signature Verdict saying why not."""
    parsed = _parse(bytes(sig))
    if isinstance(parsed, str):
        return Verdict("bad-signature", None, parsed)
    raw, digest, sigbytes = parsed
    kid = trust_keys.key_id(raw)
    if digest != hashlib.sha256(value).hexdigest():
        return Verdict("bad-signature", kid, "signed for other bytes: the value changed after it was signed")
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(sigbytes, message(key, value))
    except (InvalidSignature, ValueError):
        return Verdict("bad-signature", kid, "the signature does not verify (forged, or made for another key name)")
    return raw
