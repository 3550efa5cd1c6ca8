"""A device's peak: measured on a CPU, and the measurement kept for the next run."""

import json
import time

from zero_recipes.training import device_peak


def test_cpu_peak_is_measured():
    peak = device_peak.measure_matmul_peak("fp32", seconds=0.1)
    assert 1e8 < peak < 1e13  # a real measured rate, not a table value


def test_a_measured_peak_is_kept_for_the_next_run(tmp_path):
    """The CPU's matmul peak is measured once and read back by later runs (it held every launch's first step back
    half a second); an unreadable cache file is measured again and rewritten, never an error."""
    cache = tmp_path / "matmul-peak.json"
    first, source = device_peak.device_peak_flops("fp32", cache)
    assert 1e8 < first < 1e13 and "measured fp32 matmul" in source and " on " not in source
    again, source = device_peak.device_peak_flops("fp32", cache)
    assert again == first and source.endswith(f"on {time.strftime('%Y-%m-%d')}")
    assert [k.split(" | ")[1] for k in json.loads(cache.read_text())] == ["fp32"]
    cache.write_text("{not json")
    remeasured, source = device_peak.device_peak_flops("fp32", cache)
    assert remeasured > 1e8 and " on " not in source and len(json.loads(cache.read_text())) == 1
