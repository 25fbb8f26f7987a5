"""Portable cache archives: what crosses machines as a file.

- `reader`: the format (header, members, manifest, compression) and its one-pass reads, including
  the hashing pass that gives an archive's provenance verdict;
- `save`: a cache dir to one signed, compressed tar; `load`: an archive (or a backup dir) checked,
  extracted and swapped in; `check`: `cache verify ARCHIVE` (nothing extracted);
- `tarsafe`: bounds on what a tar stream may make us read; `diff`: two dirs, fingerprints or archives.

May import: `local`, `content`, `trust` and compilewatch's top-level basics.
"""
