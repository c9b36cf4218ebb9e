"""Launchers: a Ray job on a running cluster (`looprl submit`) and a SLURM batch script (`looprl slurm`)."""

from __future__ import annotations

import asyncio
import shlex
import time
from pathlib import Path

# Paths a job's working directory never needs: they can be large and change during a run.
DEFAULT_EXCLUDES = [".venv", ".git", "runs", "benchmarks/results", "**/__pycache__"]


def run_command(recipe: str, overrides: list[str]) -> str:
    return " ".join(["looprl", "run", shlex.quote(recipe), *map(shlex.quote, overrides)])


def submit_job(recipe: str, overrides: list[str], address: str, working_dir: str = ".",
               excludes: list[str] | None = None, follow: bool = True, env: dict[str, str] | None = None) -> int:
    """Submit `looprl run RECIPE ...` through Ray's job API, stream its logs, return its exit code.

    `address` is the dashboard's HTTP address (`http://HEAD:8265`). With `follow=False` the job id is
    printed and 0 returned as soon as the job is accepted.
    """
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    runtime_env = {"working_dir": str(Path(working_dir).resolve()),
                   "excludes": list(DEFAULT_EXCLUDES if excludes is None else excludes)}
    if env:
        runtime_env["env_vars"] = dict(env)
    deadline = time.monotonic() + 300
    while True:  # a freshly started head takes a while to register its job agent (minutes on a busy machine)
        try:
            job_id = client.submit_job(entrypoint=run_command(recipe, overrides), runtime_env=runtime_env)
            break
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2)
    print(f"looprl: submitted job {job_id} to {address}", flush=True)
    if not follow:
        return 0

    async def _tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            print(chunk, end="", flush=True)

    asyncio.run(_tail())
    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while (status := client.get_job_status(job_id)) not in terminal:
        time.sleep(0.5)
    info = client.get_job_info(job_id)
    code = getattr(info, "driver_exit_code", None)
    print(f"looprl: job {job_id} {status.value.lower()}" + (f" (exit code {code})" if code is not None else ""),
          flush=True)
    if status == JobStatus.SUCCEEDED:
        return 0
    return code if isinstance(code, int) and code != 0 else 1


SBATCH_TEMPLATE = """#!/bin/bash
# looprl on SLURM: a Ray head on the first node, Ray workers on the others, then the recipe, then teardown.
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={cpus_per_node}
{gpu_line}{partition_line}{time_line}#SBATCH --output={log_dir}/%x-%j.out
{extra_lines}
set -uo pipefail
export RAY_AUTH_MODE="${{RAY_AUTH_MODE:-disabled}}"
export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-1}}"
RAY="${{LOOPRL_RAY:-ray}}"
PYTHON="${{LOOPRL_PYTHON:-python}}"
PORT="${{LOOPRL_RAY_PORT:-{port}}}"
# Ray's socket paths must stay short: one temp dir per job under /tmp
RAY_TMP="${{LOOPRL_RAY_TMP:-/tmp/lrl-$SLURM_JOB_ID}}"
JOIN_TIMEOUT="${{LOOPRL_JOIN_TIMEOUT:-300}}"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${{NODES[0]}}"
HEAD_IP="${{LOOPRL_HEAD_IP:-$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname -I | awk '{{print $1}}')}}"
export RAY_ADDRESS="$HEAD_IP:$PORT"
echo "looprl: ${{#NODES[@]}} node(s), head $HEAD ($RAY_ADDRESS)"

PIDS=()
teardown() {{
    for pid in "${{PIDS[@]}}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${{PIDS[@]}}"; do wait "$pid" 2>/dev/null; done
    echo "looprl: ray stopped on all nodes"
}}
trap teardown EXIT

srun --nodes=1 --ntasks=1 -w "$HEAD" "$RAY" start --head --block --node-ip-address="$HEAD_IP" --port="$PORT" \\
    --num-cpus="$SLURM_CPUS_PER_TASK" {num_gpus_flag}--temp-dir="$RAY_TMP" --include-dashboard=false \\
    --disable-usage-stats &
PIDS+=($!)
for node in "${{NODES[@]:1}}"; do
    srun --nodes=1 --ntasks=1 -w "$node" "$RAY" start --block --address="$RAY_ADDRESS" \\
        --num-cpus="$SLURM_CPUS_PER_TASK" {num_gpus_flag}--disable-usage-stats &
    PIDS+=($!)
done

# wait until every node has joined (or give up after JOIN_TIMEOUT seconds)
"$PYTHON" - "${{#NODES[@]}}" "$JOIN_TIMEOUT" <<'EOF' || exit 3
import os, sys, time
import ray
want, deadline = int(sys.argv[1]), time.time() + float(sys.argv[2])
while True:
    try:
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
        alive = sum(1 for n in ray.nodes() if n["Alive"])
        ray.shutdown()
    except Exception:
        alive = 0
    if alive >= want:
        print(f"looprl: {{alive}} node(s) joined")
        break
    if time.time() > deadline:
        sys.exit(f"looprl: only {{alive}} of {{want}} node(s) joined the Ray cluster")
    time.sleep(2)
EOF

{run_command}
RC=$?
echo "looprl: recipe finished with exit code $RC"
exit $RC
"""


def render_sbatch(recipe: str, overrides: list[str], nodes: int, gpus_per_node: int = 0, cpus_per_node: int = 8,
                  partition: str | None = None, time_limit: str | None = None, job_name: str = "looprl",
                  log_dir: str = ".", port: int = 6379, extra_sbatch: list[str] | None = None) -> str:
    """The sbatch script for `looprl slurm`; every Ray/SLURM command in it can be redirected by an
    environment variable (LOOPRL_RAY, LOOPRL_PYTHON, LOOPRL_HEAD_IP, ...), which its tests use."""
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    return SBATCH_TEMPLATE.format(
        job_name=job_name, nodes=nodes, cpus_per_node=cpus_per_node, log_dir=log_dir, port=port,
        gpu_line=f"#SBATCH --gpus-per-node={gpus_per_node}\n" if gpus_per_node else "",
        partition_line=f"#SBATCH --partition={partition}\n" if partition else "",
        time_line=f"#SBATCH --time={time_limit}\n" if time_limit else "",
        extra_lines="".join(f"#SBATCH {x}\n" for x in (extra_sbatch or [])),
        num_gpus_flag=f"--num-gpus={gpus_per_node} " if gpus_per_node else "",
        run_command=run_command(recipe, overrides))
