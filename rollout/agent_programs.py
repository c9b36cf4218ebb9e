"""Agent programs written outside looprl, run against the rollout worker's OpenAI-compatible endpoint
(`rollout.openai_server`) and trained on the tokens it served.

`rollout.agent` names the program: a `.py` file (run with the worker's Python), `module:function` (called with
no arguments) or any shell command. Per episode (`rollout.n` per prompt) looprl opens a session and starts the
program with, in its environment:

* `OPENAI_BASE_URL` / `LOOPRL_BASE_URL`: the session's base URL (`.../sessions/<id>/v1`; an OpenAI client
  picks `OPENAI_BASE_URL` up by itself), `OPENAI_API_KEY` (any value: the endpoint checks none);
* `LOOPRL_PROMPT`: the dataset prompt, `LOOPRL_ROW`: its row as JSON (the answer among its fields);
* `LOOPRL_REWARD_URL`: where the program POSTs `{"reward": r}` at the episode's end (or it prints
  `{"reward": r}` as the last line of its output).

The program is trusted code of the recipe's author: it runs as a plain child process (its own process group,
ended at `rollout.agent_timeout_s`); model-written code it runs is its own to sandbox. Up to
`rollout.env_workers` programs run at once; their requests share the engine's generate calls. An episode whose
program fails, times out or reports no reward is a failed episode (reward 0, `env_error` in its metadata).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from rl.batch import Batch, pad_token_rows
from rollout.base import SamplingParams
from rollout.multiturn import Episode, episodes_to_batch
from rollout.openai_server import OpenAIServer, Session


def agent_argv(spec: str) -> list[str]:
    """The program's command line: a `.py` file, `module:function`, or a shell command."""
    if spec.endswith(".py") and " " not in spec.strip():
        return [sys.executable, spec]
    if ":" in spec and " " not in spec and "/" not in spec:
        module, function = spec.split(":", 1)
        return [sys.executable, "-c", f"import {module}; {module}.{function}()"]
    return ["/bin/sh", "-c", spec]


def run_program(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
    """(exit code, or None at the deadline; the last lines of stdout; of stderr). The program's whole process
    group is ended at the deadline."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return code, out[-4000:], err[-2000:]


def reported_reward(session: Session, stdout: str) -> float | None:
    """The reward the program POSTed, else a last output line `{"reward": r}`."""
    if session.reward is not None:
        return session.reward
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return float(last["reward"]) if isinstance(last, dict) and isinstance(last.get("reward"), (int, float)) else None


def finished_episode(session: Session, result: tuple[int | None, str, str], spec: str, timeout_s: float,
                     bos: int) -> Episode:
    """The session's recorded episode with its reward on the last turn, or failed with the reason."""
    code, out, err = result
    e, turns = session.episode, len(session.versions)
    reward = reported_reward(session, out)
    if code is None:
        e.error = f"the agent program {spec!r} did not end within {timeout_s:g} s (rollout.agent_timeout_s)"
    elif code != 0:
        e.error = f"the agent program {spec!r} exited with code {code}: {err.strip()[-500:]}"
    elif reward is None:
        e.error = (f"the agent program {spec!r} reported no reward (POST {{\"reward\": r}} to LOOPRL_REWARD_URL or "
                   f"print it as the last line)")
    elif turns == 0:
        e.error = f"the agent program {spec!r} made no request to the endpoint"
    e.prompt_ids = e.prompt_ids or [bos]
    if e.error is not None:
        e.rewards, e.types, e.failed, e.done = [0.0] * max(turns, 1), ["failed"] * max(turns, 1), 1, True
        return e
    e.rewards, e.types = [0.0] * (turns - 1) + [float(reward)], ["action"] * turns
    e.done = e.ended = True
    return e


def run_agent_episodes(server: OpenAIServer, spec: str, prompts: list[str], rows: list[dict],
                       sampling: SamplingParams, *, group_ids: list[int], metadata: list[dict] | None,
                       workers: int, timeout_s: float, max_episode_tokens: int) -> Batch:
    """`sampling.n` episodes per prompt (prompt-major rows) of the program `spec`, as one Batch."""
    server.configure(sampling, max_episode_tokens)
    n, base_seed = sampling.n, sampling.seed if sampling.seed is not None else 0
    owner = [i for i in range(len(prompts)) for _ in range(n)]
    sids = [server.open_session(seed=(base_seed * 1_000_003 + k) % (1 << 63)) for k in range(len(owner))]
    argv = agent_argv(spec)

    def episode(k: int) -> tuple[int | None, str, str]:
        i, sid = owner[k], sids[k]
        env = {**os.environ, "OPENAI_BASE_URL": server.base_url(sid), "LOOPRL_BASE_URL": server.base_url(sid),
               "OPENAI_API_KEY": "looprl", "LOOPRL_PROMPT": prompts[i], "LOOPRL_ROW": json.dumps(rows[i], default=str),
               "LOOPRL_REWARD_URL": f"{server.address}/sessions/{sid}/reward"}
        return run_program(argv, env, timeout_s)
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="looprl-agent") as pool:
        results = list(pool.map(episode, range(len(owner))))
    tok = server.tok
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    sessions = [server.close_session(sid) for sid in sids]
    episodes = [finished_episode(s, r, spec, timeout_s, bos) for s, r in zip(sessions, results)]
    ids, mask = pad_token_rows([e.prompt_ids for e in episodes], tok.pad_token_id, "left")  # as the engines'
    padded = {"input_ids": ids, "attention_mask": mask}
    given = metadata or [{} for _ in prompts]
    batch = episodes_to_batch(episodes, tok, [prompts[i] for i in owner], padded, 1, [group_ids[i] for i in owner],
                      [rows[i] for i in owner], [dict(given[i]) for i in owner])
    for m, s in zip(batch.metadata, sessions):
        m["policy_versions"] = sorted(set(s.versions))
    return batch
