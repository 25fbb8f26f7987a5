"""Long cache operations report progress through a callback (bytes done, bytes total); they never print."""

from __future__ import annotations

from compilewatch.cache.archive import load as archive_load
from compilewatch.cache.archive import save as archive_save
from compilewatch.cache.content import fingerprint as fp_mod
from tests.cache_helpers import big_cache


def _check(calls: list[tuple[int, int]], total: int) -> None:
    assert calls, "no progress reported"
    assert all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == total


def test_fingerprint_save_and_load_report_bytes(tmp_path, capsys):
    root = big_cache(tmp_path / "cache", 40, size=1000)
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    calls: list[tuple[int, int]] = []
    fp = fp_mod.fingerprint(root, use_index=False, progress=lambda d, t: calls.append((d, t)))
    _check(calls, fp.bytes)
    assert fp.bytes == total

    calls.clear()
    again = fp_mod.fingerprint(root, progress=lambda d, t: calls.append((d, t)))  # no stat index yet: hashed again
    assert again.content_hash == fp.content_hash
    _check(calls, fp.bytes)

    calls.clear()
    out = tmp_path / "c.tar.gz"
    archive_save.save(out, root, mega=False, progress=lambda d, t: calls.append((d, t)))
    _check(calls, fp.bytes)

    calls.clear()
    archive_load.load(out, tmp_path / "restored", progress=lambda d, t: calls.append((d, t)))
    _check(calls, out.stat().st_size)  # load follows the archive's (compressed) bytes
    assert capsys.readouterr() == ("", "")  # the library printed nothing
