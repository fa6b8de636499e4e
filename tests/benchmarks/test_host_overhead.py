"""The host-overhead benchmark, at a tiny size: it prints a row per mode and N, times only the
steps in which every sequence decodes, and writes its table and plot (no timing is checked)."""

from __future__ import annotations

import pytest

from benchmarks import host_overhead, timing, tiny_workload


@pytest.fixture
def results(tmp_path, monkeypatch):
    """benchmarks/results/ redirected to a temporary folder."""
    monkeypatch.setattr(timing, "RESULTS", tmp_path)
    return tmp_path


def table_rows(text: str) -> list[list[str]]:
    """The cells of the Markdown table's body rows in ``text``."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return rows[2:]


@pytest.mark.slow
def test_quick_run_writes_a_row_per_mode_and_count_and_the_plot(results):
    text = host_overhead.main(["--quick", "--num-seqs", "4,8", "--output-tokens", "6", "--rounds", "1",
                               "--num-scheduler-steps", "1,4"])
    assert sorted(path.name for path in results.iterdir()) == ["host_overhead_quick.md", "host_overhead_quick.png"]
    assert (results / "host_overhead_quick.md").read_text() == text + "\n"
    assert "Command: `PYTHONPATH=. python -m benchmarks.host_overhead --quick" in text and "Machine: " in text
    rows = table_rows(text)
    modes = ("greedy", "greedy, text", "sampled", "sampled, n=4")
    assert [tuple(row[:3]) for row in rows] == [(mode, k, n) for mode in modes for k in ("1", "4") for n in ("4", "8")]
    for row in rows:
        # 6 tokens: the first from the prefill step, then 5 steps in which every sequence decodes
        # (k=4: a loop of 4 and a step of 1, the sequences' last token).
        assert row[3] == ("5" if row[1] == "1" else "2")
        assert float(row[4]) > 0 and float(row[5]) >= float(row[4]) and float(row[6]) > 0 and float(row[-1]) > 0
        assert float(row[8]) <= float(row[4])
        assert 0 < float(row[-2]) <= float(row[8]) + 0.01  # the main thread's CPU time fits in the step's
    assert len(rows[0]) == len(host_overhead.headers())


def test_a_pass_times_only_the_steps_in_which_every_sequence_decodes(tmp_path):
    from tests.models.tiny_models import write_checkpoint

    write_checkpoint(tiny_workload.MODEL, tmp_path)
    llm = tiny_workload.LLM(str(tmp_path), **tiny_workload.engine_settings(3, 5))
    run = tiny_workload.run_pass(llm, tiny_workload.random_prompts(3, 256, seed=0), "sampled", 5)
    # One prefill step (3 x 32 tokens fit one step), then 4 steps in which every sequence
    # decodes, the last of them ending all three: one token per sequence each.
    assert len(run.all_seconds) == 5 and len(run.decode_seconds) == 4 and run.decode_tokens == [1.0] * 4
    assert len(run.decode_cpu) == 4 and all(0 < cpu <= seconds + 1e-3 for cpu, seconds in zip(run.decode_cpu,
                                                                                             run.decode_seconds))


def test_a_pass_of_parallel_samples_counts_each_sequences_tokens(tmp_path):
    from tests.models.tiny_models import write_checkpoint

    write_checkpoint(tiny_workload.MODEL, tmp_path)
    llm = tiny_workload.LLM(str(tmp_path), **tiny_workload.engine_settings(8, 5))
    run = tiny_workload.run_pass(llm, tiny_workload.random_prompts(2, 256, seed=0), "sampled, n=4", 5)
    # Two requests of 4 samples: the prefill step samples each sequence's first token, then
    # 4 steps in which all 8 decode, one token each.
    assert len(run.all_seconds) == 5 and run.decode_tokens == [1.0] * 4


def test_ratio_is_given_only_when_both_counts_were_measured():
    def result(count, *ms):
        return host_overhead.Result(count, "greedy", [m / 1e3 for m in ms], [1.0] * len(ms), 10, 0.1)

    rows = host_overhead.table_rows([result(256, 2.0, 2.0, 2.0), result(512, 5.0, 5.0, 2.0)])
    assert rows[0][9] == "1.5" and rows[1][10] == "2.50 (target <= 2.1); means 2.00"
    assert host_overhead.table_rows([result(512, 5.0)])[0][10] == "n/a (no N=256)"
