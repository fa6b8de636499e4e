"""The native kernels' build cache: one library per source, compiler, jaxlib and CPU."""

from __future__ import annotations

import os

from pallas_paged import native


def test_a_build_leaves_only_the_newest_builds_in_the_cache(tmp_path):
    """Each change of the sources adds a library to the cache; older ones beyond the newest
    few are deleted, and other files there are left alone."""
    for age, name in enumerate(["kernels-new.so", "kernels-b.so", "kernels-c.so", "kernels-d.so", "kernels-old.so",
                                "kernels-older.so"]):
        path = tmp_path / name
        path.write_bytes(b"")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))
    (tmp_path / "notes.txt").write_text("not a build")
    native._prune(tmp_path, keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kernels-b.so", "kernels-c.so", "kernels-d.so", "kernels-new.so", "notes.txt"]
