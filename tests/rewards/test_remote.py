"""`looprl serve-reward` and remote reward functions, on loopback: scores, errors, a server that dies and
comes back, and a run that uses one."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from cluster.ray_utils import free_port
from rewards.service import RewardService, RewardSpec

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = """
def digits(prompt, response, **kw):
    if response == "boom":
        raise RuntimeError("cannot score boom")
    return {"score": sum(c.isdigit() for c in response) / max(1, len(response)), "length": len(response)}
"""


def _start(plugin, port):
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve-reward", f"{plugin}:digits", "--port", str(port),
                             "--workers", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).json()["status"] == "ok":
                return proc
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"reward server did not start: {proc.stdout.read()}")


def _items(responses):
    return [{"prompt": "p", "response": r, "ground_truth": None, "metadata": {}, "truncated": False} for r in responses]


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "plug.py"
    path.write_text(PLUGIN)
    return path


def test_remote_scores_errors_and_a_server_that_dies_and_comes_back(plugin):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start(plugin, port)
    service = RewardService([RewardSpec(url, 1.0, {"batch_size": 2, "timeout_s": 5, "retries": 1,
                                                   "backoff_s": 0.1})], num_workers=1)
    try:
        scored = service.score(_items(["a1", "22", "boom", "xyz9"]))
        assert [s["score"] for s in scored] == [0.5, 1.0, 0.0, 0.25]
        assert scored[0]["components"][f"{url}/length"] == 2.0
        assert scored[2]["failed"] and "cannot score boom" in scored[2]["error"]  # one sample, not the batch
        assert not scored[3]["failed"]
        server.kill()
        server.wait()
        down = service.score(_items(["1", "2"]))
        assert all(s["failed"] and "failed after 2 tries" in s["error"] for s in down)  # recorded, no crash
        server = _start(plugin, port)  # restarted on the same address: picked up by the next request
        assert [s["score"] for s in service.score(_items(["1", "a"]))] == [1.0, 0.0]
    finally:
        service.close()
        server.kill()


@pytest.mark.slow
def test_a_run_scores_through_a_remote_reward(ray_cluster, plugin, tmp_path):
    from cluster.pipeline import run
    from tests.cluster.test_pipeline import _cfg
    port = free_port()
    server = _start(plugin, port)
    try:
        summary = run(_cfg(tmp_path, "r", "trainer.steps=1", f"reward.functions=[{{remote: 'http://127.0.0.1:{port}'}}]"))
    finally:
        server.kill()
    assert summary["steps"] == 1 and summary["reward/failures"] == 0


def test_an_unreachable_server_stops_the_run_at_start(tmp_path):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "run", "recipes/quickstart.yaml", f"output_dir={tmp_path}",
                           f"reward.functions=[{{remote: 'http://127.0.0.1:{port}'}}]", "sft.enabled=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"reward server http://127.0.0.1:{port} is not reachable" in proc.stderr
