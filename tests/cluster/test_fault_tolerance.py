"""Processes killed mid-run (SIGKILL, as the OOM killer or a failed node would): the run recovers, or
stops with a message that says how to resume."""

import subprocess
import sys
import time

import pytest

from cluster.learner import LearnerDied, LearnerStuck
from cluster.pipeline import run
from rl.loop.tracking import read_metrics
from tests.cluster.test_pipeline import COMPARE, ROOT, TINY, _cfg, _digit_reward

DYING_ENGINE = '''
import os, signal
from rollout.hf_engine import HFEngine

class DiesOnStepTwo(HFEngine):
    def generate(self, prompts, sampling, *, group_ids=None, **kw):
        # step 2's rollout carries group ids from 16 on (4 prompts per step x 4 sampling rounds)
        if group_ids and group_ids[0] == 16 and not os.path.exists({marker!r}):
            open({marker!r}, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(prompts, sampling, group_ids=group_ids, **kw)
'''

DYING_LOSS = '''
import os, signal
from rl.losses import ppo_clip_loss

def dies_on_step_two(logp, old_logp, advantages, response_mask, **kw):
    calls = int(open({count!r}).read()) if os.path.exists({count!r}) else 0
    open({count!r}, "w").write(str(calls + 1))
    if calls == 2 and not os.path.exists({marker!r}):  # two micro-batches per step: call 3 is step 2
        open({marker!r}, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return ppo_clip_loss(logp, old_logp, advantages, response_mask, **kw)
'''

STUCK_ENGINE = '''
import os, time
from rollout.hf_engine import HFEngine

class StuckOnStepTwo(HFEngine):
    def generate(self, prompts, sampling, *, group_ids=None, **kw):
        if group_ids and group_ids[0] == 16 and not os.path.exists({marker!r}):
            open({marker!r}, "w").close()
            time.sleep(3600)  # alive, never answers
        return super().generate(prompts, sampling, group_ids=group_ids, **kw)
'''

STUCK_LOSS = '''
import os, time
from rl.losses import ppo_clip_loss

def stuck_on_step_two(logp, old_logp, advantages, response_mask, **kw):
    calls = int(open({count!r}).read()) if os.path.exists({count!r}) else 0
    open({count!r}, "w").write(str(calls + 1))
    if calls == 2 and not os.path.exists({marker!r}):
        open({marker!r}, "w").close()
        time.sleep(3600)
    return ppo_clip_loss(logp, old_logp, advantages, response_mask, **kw)
'''


@pytest.mark.extended
@pytest.mark.slow
def test_killed_rollout_worker_is_restarted_and_its_rollout_regenerated(ray_cluster, tmp_path):
    engine = tmp_path / "dying_engine.py"
    engine.write_text(DYING_ENGINE.format(marker=str(tmp_path / "worker_was_killed")))
    common = ["trainer.steps=3", "learner.lr=5e-3", _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "plain", *common))
    summary = run(_cfg(tmp_path, "killed", *common, f"rollout.engine={engine}:DiesOnStepTwo"))
    assert (tmp_path / "worker_was_killed").exists()  # the worker really was killed during step 2
    plain, killed = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "killed")
    assert summary["steps"] == 3 and [m["rollout/restarts"] for m in killed] == [0, 1, 1]
    # the regenerated rollout has the same prompts and seeds and the restarted worker the current
    # weights: every step is what it is without the failure, so nothing was lost or counted twice
    for a, b in zip(plain, killed):
        assert a["batch/samples"] == b["batch/samples"] == 16
        for key in COMPARE:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.extended
@pytest.mark.slow
def test_killed_learner_stops_the_run_with_a_resumable_checkpoint(ray_cluster, tmp_path):
    loss = tmp_path / "dying_loss.py"
    loss.write_text(DYING_LOSS.format(count=str(tmp_path / "calls"), marker=str(tmp_path / "rank_was_killed")))
    args = ["trainer.steps=3", "trainer.checkpoint_every=1", "learner.lr=5e-3", _digit_reward(tmp_path),
            f"algorithm.loss={loss}:dies_on_step_two"]
    with pytest.raises(LearnerDied, match=r"learner rank\(s\) \[0\] died during a training step at step 2.*"
                                          r"resume=auto from .*step_1"):
        run(_cfg(tmp_path, "run", *args))
    resumed = run(_cfg(tmp_path, "run", *args, "resume=auto"))
    assert resumed["steps"] == 3
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]


def _private_instance(log) -> str:
    """The session folder of the Ray instance a `looprl run` started for itself, from its log."""
    line = next((x for x in log.read_text().splitlines() if "ray: started a private instance (" in x), "")
    return line.split("private instance (", 1)[1].split(")", 1)[0] if line else ""


# CI: exact resume in test_partial_rollouts_train_the_groups_that_finish_and_resume_with_their_pool, a dead role's
# stop and resume=auto with the stuck learner
@pytest.mark.extended
@pytest.mark.slow
def test_killed_driver_resumes_to_the_metrics_of_an_uninterrupted_run(ray_cluster, tmp_path):
    """The driver is a `looprl run` process beside the test session's Ray, which it does not join: it starts a
    private instance, and once it is SIGKILLed no process of that instance is left (Ray's own fate-sharing leaves
    the agents its raylet started). The resumed run reproduces the uninterrupted one."""
    from cluster.local_ray import _alive, session_processes
    common = ["trainer.steps=4", "trainer.checkpoint_every=1", "learner.lr=5e-3", _digit_reward(tmp_path)]
    run(_cfg(tmp_path, "full", *common))
    cmd = [sys.executable, "-m", "cluster.cli", "run", "recipes/quickstart.yaml", f"output_dir={tmp_path / 'killed'}",
           "sft.enabled=false", *TINY, *common]
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    marker = tmp_path / "killed" / "checkpoints" / "step_2" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    session = _private_instance(log)
    pids = session_processes(session) if session else []
    proc.kill()
    proc.wait()
    assert marker.exists() and not (tmp_path / "killed" / "summary.json").exists()  # it died mid-run
    assert session and ray_cluster.get_runtime_context().gcs_address in log.read_text(), log.read_text()[-2000:]
    names = {open(f"/proc/{p}/cmdline").read().split("\0")[0] for p in pids if _alive(p)}
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
    gone_by = time.monotonic() + 20  # the reaper's second and grace period, with room; the agents alone outlive
    while any(_alive(p) for p in pids) and time.monotonic() < gone_by:  # the raylet by a minute or more
        time.sleep(0.2)
    assert [p for p in pids if _alive(p)] == []
    resumed = run(_cfg(tmp_path, "killed", *common, "resume=auto"))
    assert resumed["steps"] == 4
    full, again = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "killed")
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    for a, b in zip(full, again):
        for key in COMPARE:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.extended  # hang detection runs in CI with the stuck learner; this is its rollout-side variant
def test_a_stuck_rollout_worker_is_killed_restarted_and_its_rollout_regenerated(ray_cluster, tmp_path):
    engine = tmp_path / "stuck_engine.py"
    engine.write_text(STUCK_ENGINE.format(marker=str(tmp_path / "worker_was_stuck")))
    summary = run(_cfg(tmp_path, "stuck", "trainer.steps=3", "learner.lr=5e-3", _digit_reward(tmp_path),
                       f"rollout.engine={engine}:StuckOnStepTwo", "trainer.deadlines.generate_s=20"))
    assert (tmp_path / "worker_was_stuck").exists()  # step 2's generation really blocked
    metrics = read_metrics(tmp_path / "stuck")
    assert summary["steps"] == 3 and [m["rollout/restarts"] for m in metrics] == [0, 1, 1]
    assert all(m["batch/samples"] == 16 for m in metrics)


@pytest.mark.slow
def test_a_stuck_learner_stops_the_run_naming_the_phase_and_the_checkpoint_to_resume_from(ray_cluster, tmp_path):
    loss = tmp_path / "stuck_loss.py"
    loss.write_text(STUCK_LOSS.format(count=str(tmp_path / "calls"), marker=str(tmp_path / "rank_was_stuck")))
    args = ["trainer.steps=3", "trainer.checkpoint_every=1", "learner.lr=5e-3", _digit_reward(tmp_path),
            f"algorithm.loss={loss}:stuck_on_step_two", "trainer.deadlines.learner_s=10"]
    with pytest.raises(LearnerStuck, match=r"learner rank\(s\) \[0\] did not finish a training step within 10 s "
                                           r"\(trainer.deadlines.learner_s\) at step 2.*resume=auto from .*step_1"):
        run(_cfg(tmp_path, "run", *args))
    resumed = run(_cfg(tmp_path, "run", *args, "resume=auto"))
    assert resumed["steps"] == 3 and [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]
