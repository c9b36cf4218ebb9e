"""`looprl serve-reward` and remote reward functions, on loopback: scores, errors, a server that dies and
comes back, and a run that uses one."""

import os
import signal
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
import os


def digits(prompt, response, **kw):
    if response == "die":  # a plugin call that kills its scoring process
        os.kill(os.getpid(), 9)
    if response == "boom":
        raise RuntimeError("cannot score boom")
    return {"score": sum(c.isdigit() for c in response) / max(1, len(response)), "length": len(response)}
"""


def _start(plugin, port, token=None, host="127.0.0.1"):
    env = {**os.environ, **({"LOOPRL_REWARD_TOKEN": token} if token else {})}
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve-reward", f"{plugin}:digits", "--port", str(port),
                             "--workers", "1", "--host", host], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1, headers=headers).json()["status"] == "ok":
                return proc
        except requests.RequestException:
            time.sleep(0.2)
    _stop(proc)
    raise RuntimeError(f"reward server did not start: {proc.stdout.read()}")


def _stop(proc):
    """The server and its scoring processes (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


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
        _stop(server)
        down = service.score(_items(["1", "2"]))
        assert all(s["failed"] and "failed after 2 tries" in s["error"] for s in down)  # recorded, no crash
        server = _start(plugin, port)  # restarted on the same address: picked up by the next request
        assert [s["score"] for s in service.score(_items(["1", "a"]))] == [1.0, 0.0]
    finally:
        service.close()
        _stop(server)


def test_a_plugin_that_kills_its_process_costs_its_batch_not_the_server(plugin):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start(plugin, port)
    try:
        dead = requests.post(f"{url}/score", json={"items": _items(["1", "die"])}, timeout=60)
        assert dead.status_code == 200
        assert all("scoring process died" in r["error"] for r in dead.json()["results"])
        health = requests.get(f"{url}/health", timeout=60).json()
        assert health["status"] == "ok" and health["restarts"] >= 1  # the pool was replaced
        after = requests.post(f"{url}/score", json={"items": _items(["11", "a"])}, timeout=60).json()["results"]
        assert [r["value"]["score"] for r in after] == [1.0, 0.0]
    finally:
        _stop(server)


@pytest.mark.parametrize("body, reason", [
    ({"items": 5}, '"items" must be a list, got int'),
    ({"items": {"prompt": "p"}}, '"items" must be a list, got dict'),
    ({"items": [3]}, "item 0 must be an object, got int"),
    ({"items": [{"prompt": "p"}]}, "item 0 needs string response"),
    ([1, 2], 'the body must be a JSON object with "items"'),
])
def test_a_malformed_request_gets_400_with_the_reason(body, reason):
    from aiohttp.test_utils import TestClient, TestServer

    from rewards.remote import make_app

    async def ask():
        async with TestClient(TestServer(make_app("exact_match", num_workers=1))) as client:
            resp = await client.post("/score", json=body)
            return resp.status, await resp.json()

    import asyncio
    status, answer = asyncio.run(ask())
    assert status == 400 and answer["error"] == f"bad request: {reason}"


def test_a_token_is_required_when_set_and_a_public_bind_without_one_is_warned_about(plugin, monkeypatch):
    """(The warning is printed by `serve` before it binds.)"""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start(plugin, port, token="t0ken")
    try:
        assert requests.post(f"{url}/score", json={"items": _items(["1"])}, timeout=30).status_code == 401
        monkeypatch.setenv("LOOPRL_REWARD_TOKEN", "t0ken")  # the client sends it
        service = RewardService([RewardSpec(url, 1.0, {"retries": 0})], num_workers=1)
        try:
            assert [s["score"] for s in service.score(_items(["1"]))] == [1.0]
        finally:
            service.close()
    finally:
        _stop(server)
    from rewards.remote import exposure_warning
    assert "WARNING: serving on 0.0.0.0 without authentication" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("0.0.0.0", "t0ken") is None and exposure_warning("127.0.0.1", None) is None


@pytest.mark.extended  # CI: the remote reward's client and server in this file's other tests
@pytest.mark.slow
def test_a_run_scores_through_a_remote_reward(ray_cluster, plugin, tmp_path):
    from cluster.pipeline import run
    from tests.cluster.test_pipeline import _cfg
    port = free_port()
    server = _start(plugin, port)
    try:
        summary = run(_cfg(tmp_path, "r", "trainer.steps=1", f"reward.functions=[{{remote: 'http://127.0.0.1:{port}'}}]"))
    finally:
        _stop(server)
    assert summary["steps"] == 1 and summary["reward/failures"] == 0


def test_an_unreachable_server_stops_the_run_at_start(tmp_path, capsys):
    """The CLI's entry point in process (the process exits with what `main` returns)."""
    from cluster.cli import main
    port = free_port()
    assert main(["run", str(ROOT / "recipes/quickstart.yaml"), f"output_dir={tmp_path}", "sft.enabled=false",
                 f"reward.functions=[{{remote: 'http://127.0.0.1:{port}'}}]"]) == 2
    assert f"reward server http://127.0.0.1:{port} is not reachable" in capsys.readouterr().err
