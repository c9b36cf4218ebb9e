"""The hardware ceilings `perf/mfu` and `perf/mbu` divide by, and the probes every actor answers."""

import subprocess
import sys
from pathlib import Path

import pytest

import rollout.hardware as hardware
from rollout.probes import ActorProbes


def test_ceilings_are_measured_once_and_again_keeps_the_best(monkeypatch):
    monkeypatch.setattr(hardware, "_RATES", {})
    first = hardware.hardware_rates("float32", seconds=0.05)
    assert first["device"] == "cpu" and first["matmul_flops"] > 1e8 and first["copy_bytes_per_s"] > 1e7
    assert hardware.hardware_rates("float32", seconds=0.05) is first  # cached: not measured again
    # a measurement taken while something else shared the cores: measuring again replaces it ...
    hardware._RATES[("float32", "cpu")] = {**first, "matmul_flops": 1.0, "copy_bytes_per_s": 1.0}
    again = hardware.hardware_rates("float32", seconds=0.05, again=True)
    assert again["matmul_flops"] > 1e8 and again["copy_bytes_per_s"] > 1e7
    # ... and a better earlier one is kept
    hardware._RATES[("float32", "cpu")] = {**first, "matmul_flops": 1e20}
    assert hardware.hardware_rates("float32", seconds=0.05, again=True)["matmul_flops"] == pytest.approx(1e20)


def test_the_driver_measures_a_nodes_ceilings_once_per_dtype_and_thread_count(ray_cluster, monkeypatch):
    """Each run asks its roles' first actors for the ceilings; a later actor with the same threads on the same node
    is not asked again in this process (a measurement occupies the cores for about a second), one with other
    threads or dtype is, and `again` asks anew and keeps the best, once: a later run's `again` is answered from
    the warm measurement."""
    import ray

    import cluster.perf as perf
    monkeypatch.setattr(perf, "_CEILINGS", {})
    monkeypatch.setattr(perf, "_MEASURED_WARM", set())

    @ray.remote(num_cpus=0)
    class Role(ActorProbes):
        def __init__(self):
            self.asked = 0

        def hardware_rates(self, dtype="float32", again=False):
            self.asked += 1
            return hardware.hardware_rates(dtype, seconds=0.02, again=again)

        def times_asked(self):
            return self.asked

    first, second = Role.remote(), Role.remote()
    rates = perf.ceilings(first, "float32", threads=1)
    assert rates["matmul_flops"] > 1e8 and perf.ceilings(second, "float32", threads=1) == rates
    assert ray.get(second.times_asked.remote()) == 0
    perf.ceilings(second, "float32", threads=2)
    perf.ceilings(second, "bfloat16", threads=2)
    assert ray.get([a.times_asked.remote() for a in (first, second)]) == [1, 2]
    node = ray.get(first.node_id.remote())
    perf._CEILINGS[(node, "float32", 1)] = {**rates, "matmul_flops": 1e20}  # a better earlier measurement
    assert perf.ceilings(second, "float32", threads=1, again=True)["matmul_flops"] == pytest.approx(1e20)
    assert ray.get(second.times_asked.remote()) == 3
    assert perf.ceilings(first, "float32", threads=1, again=True)["matmul_flops"] == pytest.approx(1e20)
    assert ray.get([a.times_asked.remote() for a in (first, second)]) == [1, 3]  # measured warm once already
    perf.ceilings(first, "float32", threads=2, again=True)  # not yet measured warm with 2 threads
    assert ray.get(first.times_asked.remote()) == 2
    for a in (first, second):
        ray.kill(a)


def test_a_call_longer_than_the_budget_is_timed_once_after_its_warm_up():
    """The probe keeps to about its budget on a slow CPU (a bf16 ceiling of 6 calls took 90 s on a CPU without bf16
    instructions): a call outlasting the budget runs twice (warm-up, one timed call); fast calls fill 5 windows."""
    import time
    calls = []

    def slow() -> None:
        calls.append(1)
        time.sleep(0.03)
    per_call = hardware.seconds_per_call(slow, total_s=0.01)
    assert len(calls) == 2 and per_call >= 0.03
    calls.clear()
    synced = []
    hardware.seconds_per_call(lambda: calls.append(1), total_s=0.01, sync=lambda: synced.append(1))
    assert len(calls) > 6 and len(synced) == len(calls)  # the warm-up and at least one call in each of 5 windows


def test_a_bf16_model_on_a_cpu_without_bf16_instructions_is_told_float32_is_faster(monkeypatch, tmp_path, capsys):
    """Where the CPU has no bf16 matrix instructions (an AVX2 EPYC: bf16 linears at a sixth of fp32's rate) the
    engine says so once, naming `model.dtype`; fp32, a CPU with them and a GPU are not told anything."""
    from models.tiny import save_tiny
    from rollout.hf_engine import HFEngine
    monkeypatch.setattr(hardware, "_WARNED", set())
    monkeypatch.setattr(hardware, "cpu_has_bf16_matmul", lambda: False)
    assert "model.dtype=float32" in hardware.bf16_advice("bfloat16")
    assert hardware.bf16_advice("float32") is None and hardware.bf16_advice("bfloat16", device="cuda") is None
    path = str(save_tiny(tmp_path, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    capsys.readouterr()
    HFEngine(path, dtype="bfloat16")
    HFEngine(path, dtype="bfloat16")
    HFEngine(path)
    assert capsys.readouterr().err.count("model.dtype=bfloat16 on a CPU without bf16 matrix instructions") == 1
    monkeypatch.setattr(hardware, "cpu_has_bf16_matmul", lambda: True)
    assert hardware.bf16_advice("bfloat16") is None


def test_the_reward_services_processes_score_without_importing_torch():
    """The reward service and its scoring processes load every built-in reward (the registry's warm-up,
    `rewards.scoring.load_rewards`) and the probes, without torch: 2 s of each one's start-up on a CPU core."""
    code = ("import sys\nimport rewards.service\nfrom rl.registry import known\n"
            "from rewards.scoring import load_rewards\nload_rewards(known('reward'))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
