"""What may be believed about bytes that come from elsewhere (archives, restored dirs, Redis values).

- `allowlist`: which pickle globals torch's caches use, and what each name resolves to (by identity);
- `picklescan`: a pickle's opcodes followed without unpickling it, with `stackmodel`: what each value
  on its stack is and who made it (only what the pickle made itself may be mutated), `calls`: what
  each allowed call may be given, `loadcost`: what the real load would allocate and compute (copies,
  hashes, memo slots), bounded; `fxsource`: the one source-executing call torch's pickles make, checked,
  with `fxbounds`: what its constants would compute while the graph is traced;
- `keys`: this machine's Ed25519 signing key and the trust store; `provenance`: an archive's signed
  statement and the own/trusted/foreign verdict; `backups`: the record of backup dirs made here;
- `modes`: the one owner-and-mode check (like OpenSSH's StrictModes) on the config dir, the signing
  key, the trust store and the backups record, and every directory above them.

May import: compilewatch's top-level basics only (no other cache room).
"""
