"""The hardware ceilings `perf/mfu` and `perf/mbu` divide by."""

import pytest

import rollout.probes as probes


def test_ceilings_are_measured_once_and_again_keeps_the_best(monkeypatch):
    monkeypatch.setattr(probes, "_RATES", {})
    first = probes.hardware_rates("float32", seconds=0.05)
    assert first["device"] == "cpu" and first["matmul_flops"] > 1e8 and first["copy_bytes_per_s"] > 1e7
    assert probes.hardware_rates("float32", seconds=0.05) is first  # cached: not measured again
    # a measurement taken while something else shared the cores: measuring again replaces it ...
    probes._RATES[("float32", "cpu")] = {**first, "matmul_flops": 1.0, "copy_bytes_per_s": 1.0}
    again = probes.hardware_rates("float32", seconds=0.05, again=True)
    assert again["matmul_flops"] > 1e8 and again["copy_bytes_per_s"] > 1e7
    # ... and a better earlier one is kept
    probes._RATES[("float32", "cpu")] = {**first, "matmul_flops": 1e20}
    assert probes.hardware_rates("float32", seconds=0.05, again=True)["matmul_flops"] == pytest.approx(1e20)
