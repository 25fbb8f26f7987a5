"""torch's Redis remote caches.

- `keyspace`: torch's Redis keys and values across versions (one table);
- `server`: status, verify, capped reads, the server's security posture;
- `sync`: push (from a verified dir or archive), pull (through `cache load`'s checks), clear (with a
  backup).

May import: every other cache room and compilewatch's top-level basics.
"""
