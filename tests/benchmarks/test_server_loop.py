"""The server-loop benchmark, at a tiny size: a row per stream interval and N, over the steps
in which every sequence decodes, and its table written (no timing is checked)."""

from __future__ import annotations

import pytest

from benchmarks import server_loop, timing
from tests.benchmarks.test_host_overhead import table_rows


@pytest.mark.slow
def test_quick_run_streams_every_request_and_writes_a_row_per_count(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "RESULTS", tmp_path)
    text = server_loop.main(["--quick", "--num-seqs", "2,4", "--output-tokens", "6", "--rounds", "1",
                              "--stream-interval", "1,3"])
    assert (tmp_path / "server_loop_quick.md").read_text() == text + "\n"
    assert "Command: `PYTHONPATH=. python -m benchmarks.server_loop --quick" in text and "Machine: " in text
    rows = table_rows(text)
    assert [row[:2] for row in rows] == [["1", "2"], ["1", "4"], ["3", "2"], ["3", "4"]]
    for row in [row[1:] for row in rows]:
        # 6 tokens each: the first from a prefill step, then at most 5 steps in which every
        # sequence decodes. Fewer when the requests reach the engine's thread in different
        # steps, as a busy machine's event loop may hand them over (a server's arrivals are
        # not synchronised with its steps).
        assert 1 <= int(row[1]) <= 5
        whole, inner, rest = float(row[2]), float(row[5]), float(row[6])
        assert whole >= inner > 0 and rest == pytest.approx(whole - inner, abs=0.011) and float(row[3]) > 0
