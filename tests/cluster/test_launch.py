"""`looprl slurm`: the rendered sbatch script, checked by bash and executed on loopback with fake SLURM tools."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster.launch import render_sbatch
from cluster.ray_utils import free_port
from tests.cluster import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
TINY = [*TINY_RUN, "trainer.steps=1"]


def test_rendered_script_is_valid_bash_with_the_requested_allocation(tmp_path):
    script = render_sbatch("recipes/quickstart.yaml", ["trainer.steps=5", "output_dir=runs/a b"], nodes=4,
                           gpus_per_node=8, cpus_per_node=32, partition="gpu", time_limit="12:00:00",
                           extra_sbatch=["--account=rl"])
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=32",
                 "#SBATCH --partition=gpu", "#SBATCH --time=12:00:00", "#SBATCH --account=rl", "--num-gpus=8"):
        assert line in script
    assert "looprl run recipes/quickstart.yaml trainer.steps=5 'output_dir=runs/a b'" in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    with pytest.raises(ValueError, match="nodes"):
        render_sbatch("r.yaml", [], nodes=0)


def test_cli_writes_the_script_and_rejects_a_bad_recipe(tmp_path, capsys):
    """The CLI's entry point in process (`python -m cluster.cli` exits with what `main` returns)."""
    from cluster.cli import main
    out = tmp_path / "j.sbatch"
    assert main(["slurm", str(ROOT / "recipes/quickstart.yaml"), "--nodes", "2", "--out", str(out),
                 "trainer.steps=3"]) == 0, capsys.readouterr().err
    assert "#SBATCH --nodes=2" in out.read_text() and "trainer.steps=3" in out.read_text()
    capsys.readouterr()
    assert main(["slurm", str(ROOT / "recipes/quickstart.yaml"), "--nodes", "2", "--out", str(tmp_path / "x.sbatch"),
                 "trainer.stepz=3"]) == 2
    assert "trainer.stepz" in capsys.readouterr().err and not (tmp_path / "x.sbatch").exists()


def _fake_slurm(bindir: Path) -> None:
    """`scontrol show hostnames` prints this machine; `srun [opts] -w HOST cmd...` runs cmd here."""
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    (bindir / "srun").write_text(
        "#!/bin/bash\nwhile [[ $# -gt 0 && $1 == -* ]]; do\n"
        "  case $1 in -w) shift 2 ;; *) shift ;; esac\ndone\nexec \"$@\"\n")
    for f in ("scontrol", "srun"):
        (bindir / f).chmod(0o755)


@contextlib.contextmanager
def _fake_slurm_job(tmp_path):
    """`launch(name, *overrides)` runs the rendered sbatch script of quickstart.yaml on loopback with fake SLURM
    tools; `leftovers()` lists this job's Ray processes. Whatever is left is killed at exit."""
    import psutil
    fake = tmp_path / "bin"
    _fake_slurm(fake)
    venv_bin = Path(sys.executable).parent
    ray_tmp = Path(tempfile.mkdtemp(prefix="lrs", dir="/tmp"))
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{venv_bin}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "2",
           "LOOPRL_HEAD_IP": "127.0.0.1", "LOOPRL_RAY_PORT": str(free_port()), "LOOPRL_RAY_TMP": str(ray_tmp),
           "LOOPRL_RAY": str(venv_bin / "ray"), "LOOPRL_PYTHON": sys.executable, "LOOPRL_JOIN_TIMEOUT": "120"}
    env.pop("RAY_ADDRESS", None)

    def launch(name, *overrides):
        script = tmp_path / f"{name}.sbatch"
        script.write_text(render_sbatch("recipes/quickstart.yaml", [f"output_dir={tmp_path / name}", *overrides],
                                        nodes=1, cpus_per_node=2))
        return subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    def leftovers():
        return [p for p in psutil.process_iter(["cmdline"]) if str(ray_tmp) in " ".join(p.info["cmdline"] or [])]

    try:
        yield launch, leftovers
    finally:
        for p in leftovers():
            p.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_script_starts_ray_runs_the_recipe_and_tears_down(tmp_path):
    import psutil
    with _fake_slurm_job(tmp_path) as (launch, leftovers):
        ok = launch("ok", *TINY)
        log = ok.stdout + ok.stderr
        assert ok.returncode == 0, log[-3000:]
        assert "1 node(s) joined" in log and "ray: joined" in log and "ray stopped on all nodes" in log
        assert json.loads((tmp_path / "ok" / "summary.json").read_text())["steps"] == 1
        psutil.wait_procs(leftovers(), timeout=30)
        assert not leftovers()


@pytest.mark.extended  # the launch and teardown run in CI above; this is the failing recipe's path
@pytest.mark.slow
def test_a_failing_recipe_is_the_jobs_exit_code_and_ray_is_torn_down_all_the_same(tmp_path):
    import psutil
    with _fake_slurm_job(tmp_path) as (launch, leftovers):
        bad = launch("bad", *TINY, "reward.functions=[{name: 'no_such_module:fn'}]")
        assert bad.returncode == 2, (bad.stdout + bad.stderr)[-3000:]
        assert "ray stopped on all nodes" in bad.stdout
        psutil.wait_procs(leftovers(), timeout=30)
        assert not leftovers()
