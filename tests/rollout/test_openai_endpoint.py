"""The OpenAI-compatible endpoint for agent programs written outside looprl: plain HTTP clients (no looprl import)
run episodes against a real hf engine, and the batch trains on exactly the tokens that were served."""

import json
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from models.families import response_logprobs
from rollout.agent_programs import agent_argv, run_agent_episodes
from rollout.base import SamplingParams
from rollout.openai_server import OpenAIServer, parse_tool_calls

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["12+3*4=", "5+6*7="]
ROWS = [{"answer": "24"}, {"answer": "47"}]

# A client that knows nothing of looprl: a three-turn chat with a tool result between turns; it writes what the
# endpoint served (token ids, logprobs, the prompt ids of each request) to LOG_DIR/<session>.json
CLIENT = textwrap.dedent('''
    import json, os, urllib.request
    base = os.environ["OPENAI_BASE_URL"]
    def post(url, body):
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())
    messages, served = [{"role": "user", "content": os.environ["LOOPRL_PROMPT"]}], []
    for turn in range(3):
        reply = post(base + "/chat/completions", {"model": "m", "messages": messages, "max_tokens": 5,
                                                  "logprobs": True})
        choice = reply["choices"][0]
        served.append({"prompt_token_ids": reply["prompt_token_ids"], "token_ids": choice["token_ids"],
                       "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]})
        messages += [{"role": "assistant", "content": choice["message"]["content"]},
                     {"role": "tool", "content": "=" + str(turn)}]
    post(os.environ["LOOPRL_REWARD_URL"], {"reward": 0.25 * len(served)})
    session = base.rstrip("/").split("/")[-2]
    open(os.path.join(os.environ["LOG_DIR"], session + ".json"), "w").write(json.dumps(served))
''')


@pytest.fixture(scope="module")
def server(engine):
    return OpenAIServer(engine, lock=threading.Lock(), version=lambda: 7)


def _episodes(server, spec, n=2, **kw):
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=8, seed=kw.pop("seed", 3))
    return run_agent_episodes(server, spec, PROMPTS, ROWS, sp, group_ids=[0, 1], metadata=None,
                              workers=kw.pop("workers", 4), timeout_s=kw.pop("timeout_s", 60.0),
                              max_episode_tokens=kw.pop("max_episode_tokens", 96))


def test_a_plain_http_agent_is_trained_on_exactly_the_tokens_it_was_served(engine, server, tmp_path, monkeypatch):
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    monkeypatch.setenv("LOG_DIR", str(tmp_path))
    b = _episodes(server, str(client))
    logs = sorted(tmp_path.glob("*.json"))
    assert len(b) == 4 and len(logs) == 4 and b.group_id.tolist() == [0, 0, 1, 1]
    by_prompt = {tuple(json.loads(p.read_text())[0]["prompt_token_ids"]): json.loads(p.read_text()) for p in logs}
    for i in range(len(b)):
        prompt = b.prompt_ids[i][b.prompt_mask[i].bool()].tolist()
        served = next(s for s in map(json.loads, (p.read_text() for p in logs))
                      if s[-1]["prompt_token_ids"] + s[-1]["token_ids"]
                      == prompt + b.response_ids[i][b.response_attn[i].bool()].tolist())
        assert served[0]["prompt_token_ids"] == prompt and tuple(prompt) in by_prompt
        n = int(b.response_attn[i].sum())
        action = b.response_mask[i, :n].bool()
        assert b.response_ids[i, :n][action].tolist() == sum((s["token_ids"] for s in served), [])
        assert torch.allclose(b.rollout_logp[i, :n][action], torch.tensor(sum((s["logprobs"] for s in served), [])))
        # each request was generated from the ids recorded before it: the trained context is the served one
        for k, s in enumerate(served[1:], 1):
            assert s["prompt_token_ids"][:len(served[k - 1]["prompt_token_ids"])] == served[k - 1]["prompt_token_ids"]
        assert b.step_rewards[i] == [0.0, 0.0, 0.75] and b.metadata[i]["turns"] == 3
        assert b.metadata[i]["policy_versions"] == [7] and not b.truncated[i]
        # between two replies exactly what the client added: the tool result and the template's turn markers
        added = engine.tokenizer.decode(b.response_ids[i, :n][~action], skip_special_tokens=False)
        assert added.count("<|assistant|>") == 2 and added.count("=0") == added.count("=1") == 1, added
        assert PROMPTS[0] not in added and PROMPTS[1] not in added
    logp, _ = response_logprobs(engine.model, b)  # the learner, reading the ids, gets the engine's logprobs
    mask = b.response_mask.bool()
    assert torch.allclose(logp[mask], b.rollout_logp[mask], atol=1e-5)


def test_the_worked_example_agent_runs_its_calculator_turns(server, engine):
    b = _episodes(server, str(ROOT / "recipes/extending/agent.py"))
    assert len(b) == 4 and all(1 <= m["turns"] <= 3 for m in b.metadata) and "env_error" not in b.metadata[0]
    assert all(r[-1] in (0.0, 1.0) for r in b.step_rewards)
    multi = [i for i, m in enumerate(b.metadata) if m["turns"] > 1]
    for i in multi:  # the agent's tool replies came back as observation tokens, masked out of the loss
        assert b.observation_mask[i].sum() > 0 and (b.response_mask[i][b.observation_mask[i].bool()] == 0).all()


def test_episodes_sample_whatever_the_runs_seed(server):
    """A run's seed and step make large sampling seeds; the episodes' request seeds stay within torch's range."""
    b = _episodes(server, str(ROOT / "recipes/extending/agent.py"), seed=(1 << 62) + 12_345)
    assert not [m["env_error"] for m in b.metadata if "env_error" in m]
    assert all(m["turns"] >= 1 for m in b.metadata) and b.response_attn.sum() > 0


def _post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        return 200, json.loads(urllib.request.urlopen(req, timeout=60).read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_sessions_refuse_rewritten_history_unknown_ids_and_bad_bodies(server):
    server.configure(SamplingParams(max_new_tokens=4, temperature=1.0), max_episode_tokens=64)
    sid = server.open_session(seed=1)
    url = server.base_url(sid)
    code, first = _post(f"{url}/completions", {"prompt": "12+3*4=", "max_tokens": 3, "logprobs": 0})
    assert code == 200 and first["object"] == "text_completion" and len(first["choices"][0]["token_ids"]) <= 3
    served = "12+3*4=" + first["choices"][0]["text"]
    code, _ = _post(f"{url}/completions", {"prompt": served + " then", "max_tokens": 2})
    assert code == 200  # it extends the session
    code, text = _post(f"{url}/completions", {"prompt": "another conversation", "max_tokens": 2})
    assert code == 409 and "open a new session" in text
    code, via_header = _post(f"{server.address}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2},
                             headers={"X-Session-Id": server.open_session()})
    assert code == 200 and via_header["prompt_token_ids"] == [5, 6, 7]
    assert _post(f"{server.address}/sessions/nope/v1/completions", {"prompt": "1"})[0] == 404
    assert _post(f"{url}/chat/completions", {"messages": "hi"})[0] == 400
    assert _post(f"{server.address}/sessions/{sid}/reward", {"reward": "high"})[0] == 400
    session = server.close_session(sid)
    assert len(session.versions) == 2 and session.episode.observation.count(1) > 0


def test_a_failing_silent_or_slow_program_is_a_failed_episode(server, tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("raise SystemExit('the agent broke')\n")
    silent = tmp_path / "silent.py"
    silent.write_text(CLIENT.replace('post(os.environ["LOOPRL_REWARD_URL"], {"reward": 0.25 * len(served)})', "")
                      .replace('open(os.path.join(os.environ["LOG_DIR"], session + ".json"), "w")', "open(os.devnull, 'w')"))
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    for spec, reason, kw in ((crash, "exited with code 1: the agent broke", {}),
                             (silent, "reported no reward", {}),
                             (slow, "did not end within 1 s (rollout.agent_timeout_s)", {"timeout_s": 1.0})):
        b = _episodes(server, str(spec), n=1, **kw)
        assert all(reason in m["env_error"] for m in b.metadata), (spec.name, b.metadata)
        assert all(t == ["failed"] * len(t) for t in b.step_types) and (b.response_mask.sum() == 0 or spec == silent)


def test_the_program_spec_and_tool_call_parsing():
    assert agent_argv("recipes/extending/agent.py") == [sys.executable, "recipes/extending/agent.py"]
    assert agent_argv("my_agents:run")[:2] == [sys.executable, "-c"]
    assert agent_argv("node agent.js --fast") == ["/bin/sh", "-c", "node agent.js --fast"]
    content, calls = parse_tool_calls('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert content == "Let me add." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert parse_tool_calls("no call") == ("no call", [])
