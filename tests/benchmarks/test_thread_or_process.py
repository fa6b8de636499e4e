"""The thread-or-process benchmark, at a tiny size: both modes stream every request, on the
CPU's tiny model and on the GPU run's model shape (here on the CPU, quick), and its table is
written (no timing is checked)."""

from __future__ import annotations

import pytest

from benchmarks import engine_process, timing
from tests.benchmarks.test_host_overhead import table_rows

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("gpu", [False, True])
def test_quick_run_streams_in_both_modes_and_writes_a_row_per_mode(tmp_path, monkeypatch, gpu):
    monkeypatch.setattr(timing, "RESULTS", tmp_path)
    text = engine_process.main(["--quick", "--num-seqs", "3", "--rounds", "1", "--repeats", "1"]
                               + (["--gpu"] if gpu else []))
    name = "gpu_engine_process_quick.md" if gpu else "engine_process_quick.md"
    assert (tmp_path / name).read_text() == text + "\n"
    assert "Command: `PYTHONPATH=. python -m benchmarks.engine_process" in text
    rows = table_rows(text)
    assert [row[:3] for row in rows] == [["3", "thread", "1"], ["3", "process", "1"]]
    assert all(float(row[5]) > 0 for row in rows) and float(rows[1][6]) > 0
