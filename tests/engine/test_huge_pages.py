"""The engine's weights and KV cache on 2 MiB pages (engine.worker.huge_pages)."""

from __future__ import annotations

import platform
import re
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import SamplingParams
from engine.worker import huge_pages
from tests.engine.tiny import tiny_llm


def _huge_bytes_of_mapping(address: int) -> int:
    """AnonHugePages of the memory mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_regions_cover_every_byte_of_every_buffer():
    arrays = [jnp.arange(n, dtype=jnp.float32) for n in (1, 1000, 3 << 20)]
    starts = huge_pages.regions(arrays)
    assert starts == sorted(set(starts)) and all(start % huge_pages.HUGE_PAGE == 0 for start in starts)
    for array in arrays:
        first, end = array.unsafe_buffer_pointer(), array.unsafe_buffer_pointer() + array.nbytes
        covered = [start for start in starts if start < end and start + huge_pages.HUGE_PAGE > first]
        assert covered[0] <= first and covered[-1] + huge_pages.HUGE_PAGE >= end
        assert all(b - a == huge_pages.HUGE_PAGE for a, b in zip(covered, covered[1:]))


@pytest.mark.skipif(not huge_pages.enabled(), reason="needs Linux with transparent huge pages on a CPU")
def test_collapsing_keeps_the_values_and_gives_huge_pages():
    values = np.random.default_rng(0).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
    array = jnp.asarray(values)
    collapsed = huge_pages.back_with_huge_pages([array])
    np.testing.assert_array_equal(np.asarray(array), values)
    if tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2]) >= (6, 1):  # MADV_COLLAPSE
        # Of the 32 or 33 regions the 64 MiB overlap, Linux may refuse some (see
        # back_with_huge_pages); those it took are huge pages now, bar the two at the edges,
        # which may belong to a neighbouring mapping.
        assert collapsed >= 1
        assert _huge_bytes_of_mapping(array.unsafe_buffer_pointer()) >= (collapsed - 2) * huge_pages.HUGE_PAGE


@pytest.mark.skipif(not huge_pages.enabled(), reason="needs Linux with transparent huge pages on a CPU")
def test_asking_goes_on_after_the_arrays_are_donated(monkeypatch):
    """The engine's first step donates the KV cache's arrays (deletes them) while the thread
    may not have started yet: it asks for the regions found when it was started."""
    class Deferred(threading.Thread):
        def start(self):  # runs only when the test calls run(), after the arrays are gone
            pass

    monkeypatch.setattr(huge_pages.threading, "Thread", Deferred)
    arrays = [jnp.zeros(1 << 20, jnp.float32) + i for i in range(4)]
    thread = huge_pages.start(arrays, "test")
    for array in arrays:
        array.delete()
    thread.run()


def test_the_engine_backs_its_weights_and_cache_and_still_generates_the_same_tokens(monkeypatch, tmp_path):
    """With and without huge pages (``PALLAS_PAGED_HUGE_PAGES=0``) under the weights and the KV
    cache, greedy decoding gives the same tokens; the cache keeps its memory from step to step
    (its programs update it in place), so it keeps the pages."""
    outputs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("PALLAS_PAGED_HUGE_PAGES", setting)
        llm, _ = tiny_llm("llama_gqa_tied", tmp_path / setting)
        cache = llm.engine.cache
        addresses = [array.unsafe_buffer_pointer() for array in jax.tree.leaves(cache.kv_caches)]
        for thread in (llm.engine._huge_pages, cache._huge_pages):
            assert (thread is not None) == (setting == "1" and huge_pages.enabled())
            if thread is not None:
                thread.join(timeout=60)
                assert not thread.is_alive()
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        generated = llm.generate([[1, 2, 3, 4], [5, 6]], params, use_tqdm=False)
        outputs[setting] = [o.outputs[0].token_ids for o in generated]
        assert [array.unsafe_buffer_pointer() for array in jax.tree.leaves(cache.kv_caches)] == addresses
    assert outputs["1"] == outputs["0"]
