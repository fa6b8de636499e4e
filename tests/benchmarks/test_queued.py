"""The queued-requests benchmark, at a tiny size: a row per mode and scheduling, lookaheads only
with async scheduling, every request's tokens counted (no timing is checked)."""

from __future__ import annotations

import pytest

from benchmarks import queued, timing, tiny_workload
from tests.benchmarks.test_host_overhead import table_rows


@pytest.mark.slow
def test_quick_run_writes_a_row_per_mode_and_scheduling(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "RESULTS", tmp_path)
    text = queued.main(["--quick", "--num-seqs", "4"])
    assert [path.name for path in tmp_path.iterdir()] == ["queued_quick.md"]
    assert "Command: `PYTHONPATH=. python -m benchmarks.queued --quick" in text and "Machine: " in text
    rows = table_rows(text)
    assert [tuple(row[:4]) for row in rows] == [("4", "16", mode, name) for mode in queued.QUEUED_MODES
                                                for name in queued.SCHEDULING]
    for row in rows:
        assert float(row[4]) > 0 and int(row[5]) > 0 and float(row[7]) > 0
        assert (row[6] == "0%") is (row[3] == "sync")


def test_a_pass_queues_requests_and_counts_their_tokens(tmp_path):
    from tests.models.tiny_models import write_checkpoint

    write_checkpoint(tiny_workload.MODEL, tmp_path)
    llm = tiny_workload.LLM(str(tmp_path), **tiny_workload.engine_settings(2, queued.OUTPUT_TOKENS[1]))
    batch = queued.requests(6, 256, "greedy", seed=3)
    run = queued.run_pass(llm, batch)
    assert run.tokens == sum(params.max_tokens for _, params in batch)
    assert run.steps >= run.tokens / 2 and run.queued_decode_seconds and 0 < run.lookahead_steps < run.steps
    assert all(queued.OUTPUT_TOKENS[0] <= params.max_tokens <= queued.OUTPUT_TOKENS[1] for _, params in batch)
