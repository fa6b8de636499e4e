"""The single-sequence benchmark leaves out decodes during which the machine changed state."""

from benchmarks.throughput import steady_samples


def test_a_decode_whose_bandwidth_readings_disagree_is_left_out():
    steady, flipped, within = (30e9, 33e9, 50.0, 60.0), (30e9, 50e9, 70.0, 80.0), (50e9, 59e9, 70.0, 80.0)
    assert steady_samples([steady, flipped, within]) == [steady, within]  # 59 is within 1.2 times 50: kept
    assert steady_samples([flipped, (51e9, 31e9, 1.0, 2.0)]) == [flipped, (51e9, 31e9, 1.0, 2.0)]  # none steady: all
    assert steady_samples([steady, flipped], tolerance=1.0) == [steady, flipped]
