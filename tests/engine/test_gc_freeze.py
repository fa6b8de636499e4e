"""The engine loops freeze the collector's older objects while they run (and collect the young
ones less often), and thaw them after."""

from __future__ import annotations

import gc
import threading

from engine import SamplingParams, gc_freeze
from tests.engine.tiny import tiny_llm


def test_nested_and_overlapping_loops_thaw_only_when_the_last_leaves():
    # No loop runs now. (Not "nothing is frozen": CPython 3.12 starts with a few hundred
    # objects frozen, which stay so until a loop first thaws.)
    assert gc_freeze._holders == 0
    thresholds = gc.get_threshold()
    entered, leave = threading.Event(), threading.Event()

    def other_loop():
        with gc_freeze.older_objects_frozen():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other_loop)
    try:
        with gc_freeze.older_objects_frozen():
            assert gc.get_freeze_count() > 0
            thread.start()
            entered.wait(10)
            with gc_freeze.older_objects_frozen():
                assert gc.get_freeze_count() > 0
                assert gc.get_threshold()[0] >= gc_freeze.LOOP_THRESHOLD
        assert gc.get_freeze_count() > 0  # the thread's loop still runs
        assert gc.get_threshold()[0] >= gc_freeze.LOOP_THRESHOLD
    finally:
        leave.set()
        thread.join()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds

def test_generate_runs_frozen_and_leaves_nothing_frozen(tmp_path, monkeypatch):
    llm, config = tiny_llm("llama_gqa_tied", tmp_path)
    counts = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (counts.append(gc.get_freeze_count()), step())[1])
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert counts and all(count > 0 for count in counts)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold()[0] < gc_freeze.LOOP_THRESHOLD
