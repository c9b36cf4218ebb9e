"""`ray start --head`, then `ray job submit --working-dir . -- recipes/quickstart.yaml` (an executable recipe) and
`looprl submit recipes/quickstart.yaml`, on loopback."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster.ray_utils import free_port
from tests.cluster import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _ray_head():
    """A Ray head of its own on loopback (every port free, a short temp dir); yields (ray CLI, env, address)."""
    bindir = Path(sys.executable).parent
    ray_bin = shutil.which("ray", path=str(bindir)) or shutil.which("ray")
    assert ray_bin, "the ray CLI must be installed with looprl"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    # every port of its own: another Ray on the machine (a user's, a benchmark's) holds the default agent ports
    gcs_port, dash_port, agent_http, agent_grpc = free_port(), free_port(), free_port(), free_port()
    # Ray's socket paths must stay under 108 bytes: a short temp dir, not pytest's deep tmp_path
    ray_tmp = Path(tempfile.mkdtemp(prefix="lrl", dir="/tmp"))
    start = subprocess.run([ray_bin, "start", "--head", "--port", str(gcs_port), "--num-cpus", "2",
                            "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
                            "--dashboard-port", str(dash_port), "--dashboard-agent-listen-port", str(agent_http),
                            "--dashboard-agent-grpc-port", str(agent_grpc), "--disable-usage-stats",
                            "--temp-dir", str(ray_tmp)], env=env, capture_output=True, text=True, timeout=120)
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        yield ray_bin, env, f"http://127.0.0.1:{dash_port}"
    finally:
        _stop_head(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_ray_job_submit_runs_the_quickstart(tmp_path):
    out_dir = tmp_path / "run"
    with _ray_head() as (ray_bin, env, address):
        deadline = time.monotonic() + 300
        while True:  # a freshly started head takes a while to register its job agent (longer on a busy machine)
            submit = subprocess.run(
                [ray_bin, "job", "submit", "--address", address, "--working-dir", str(ROOT),
                 "--runtime-env-json", json.dumps({"excludes": [".venv", ".git", "runs", "benchmarks/results"]}),
                 # the recipe itself is the entrypoint: its first line runs it with `looprl run`
                 "--", "recipes/quickstart.yaml", f"output_dir={out_dir}", "trainer.steps=2",
                 *TINY_RUN], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
            if "No available agent" not in submit.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert submit.returncode == 0, (submit.stdout[-3000:], submit.stderr[-3000:])
        assert "succeeded" in submit.stdout + submit.stderr
        # the job attached to the running head instead of starting its own Ray
        assert "ray: joined" in submit.stdout + submit.stderr
        summary = json.loads((out_dir / "summary.json").read_text())
        assert summary["steps"] == 2
        assert len((out_dir / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.extended  # CI: the job path itself (test_ray_job_submit_runs_the_quickstart)
@pytest.mark.slow
def test_looprl_submit_returns_the_failed_jobs_status_and_error(tmp_path):
    # looprl's own submit streams the job's log and returns its exit code: a recipe that fails on the cluster
    # (an unimportable reward plugin) fails the command, with the job's error in its output
    with _ray_head() as (_, env, address):
        looprl = [sys.executable, "-m", "cluster.cli", "submit", "recipes/quickstart.yaml", "--address", address]
        deadline = time.monotonic() + 300
        while True:
            bad = subprocess.run([*looprl, f"output_dir={tmp_path / 'bad'}", "trainer.steps=1", *TINY_RUN,
                                  "reward.functions=[{name: 'no_such_module:fn'}]"],
                                 env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
            if "No available agent" not in bad.stdout + bad.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert bad.returncode != 0 and "no_such_module" in bad.stdout + bad.stderr
        assert "failed" in bad.stdout  # the job's final status, printed once its log has ended


def _stop_head(temp_dir: Path) -> None:
    """Stop only this test's head node (its processes name its temp dir); `ray stop` would stop every
    Ray cluster on the machine, including a user's run."""
    import psutil
    procs = [p for p in psutil.process_iter(["cmdline"]) if str(temp_dir) in " ".join(p.info["cmdline"] or [])]
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)  # a private head: nothing to shut down gracefully
    for p in alive:
        p.kill()
