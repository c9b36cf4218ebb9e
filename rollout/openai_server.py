"""An OpenAI-compatible endpoint on a rollout engine, so that agent programs written outside looprl can be trained.

The rollout worker serves `POST /sessions/<id>/v1/chat/completions` and `/sessions/<id>/v1/completions` (so
an OpenAI client only needs `base_url=http://host:port/sessions/<id>/v1`; the plain `/v1/...` routes take the
session from an `X-Session-Id` header) and `POST /sessions/<id>/reward` (`{"reward": r}`), where the agent
reports the episode's reward at its end. Every request of a session is recorded on token ids, as
`rollout.multiturn` records an environment's episode: the ids the engine sampled, their logprobs and the
policy version that sampled them are kept as sampled; what the agent adds between two requests (a tool's
result, the chat template's turn markers) is the part of the new prompt after the text the session already
holds, tokenised once and masked out of the loss. So the trainer trains on the tokens that were served, with no
re-tokenisation. A request whose prompt does not extend its session's text (an agent that rewrote or dropped
history) is refused with 409: such an agent opens a new session.

Sampling: the recipe's (`rollout.temperature`, `top_p`, `top_k`), whatever the request asks, so that the
learner's logprobs are of the distribution that sampled; a request's `max_tokens` (capped by
`rollout.max_new_tokens` and what is left of `rollout.max_episode_tokens`) and `stop` are honoured. Tool calls:
the tools of a chat request go to the chat template; a reply holding `<tool_call>{"name": ..., "arguments":
...}</tool_call>` (the Hermes / Qwen convention) comes back as `tool_calls`. Every response also carries
`prompt_token_ids`, each choice's `token_ids` and the `policy_version` (as vLLM's `return_token_ids` does).
Requests that arrive together are generated in one engine call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import re
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollout.base import SamplingParams
from rollout.multiturn import Episode, append_action


class SessionConflict(ValueError):
    """A request that does not extend its session's conversation (HTTP 409)."""


@dataclass
class Session:
    seed: int
    episode: Episode = field(default_factory=lambda: Episode(env=None, prompt_ids=[]))
    text: str = ""  # the decoded ids so far, prompt and response: what the next prompt must start with
    versions: list[int] = field(default_factory=list)  # policy version of each request's sampling
    reward: float | None = None
    messages: list[dict] = field(default_factory=list)  # the last chat request's messages
    lock: threading.Lock = field(default_factory=threading.Lock)


class RequestBatcher:
    """Generates what concurrent sessions ask for in shared engine calls: a thread takes every queued request
    (up to `max_batch`, of one stop list) into one `generate_ids` call under `lock`."""

    def __init__(self, engine: Any, lock: threading.Lock, max_batch: int = 256):
        self.engine, self.lock, self.max_batch = engine, lock, max_batch
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="looprl-openai-batcher", daemon=True).start()

    def submit(self, ids: list[int], sampling: SamplingParams, seed: int) -> Future:
        future: Future = Future()
        self.queue.put((ids, sampling, seed, future))
        return future

    def _serve(self) -> None:
        while True:
            waiting = [self.queue.get()]
            while len(waiting) < self.max_batch and not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            by_stop: dict[tuple, list] = {}
            for item in waiting:
                by_stop.setdefault(tuple(item[1].stop or ()), []).append(item)
            for items in by_stop.values():
                self._generate(items)

    def _generate(self, items: list) -> None:
        budgets = [sp.max_new_tokens for _, sp, _, _ in items]
        sp = dataclasses.replace(items[0][1], max_new_tokens=max(budgets))
        try:
            with self.lock:
                outs = self.engine.generate_ids([ids for ids, *_ in items], sp, seeds=[s for _, _, s, _ in items])
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the engine's error
            for *_, future in items:
                future.set_exception(exc)
            return
        for out, budget, (*_, future) in zip(outs, budgets, items):
            ended = out.ended and len(out.ids) <= budget
            future.set_result((out.ids[:budget], out.logprobs[:budget], ended))


TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The reply's content before its first `<tool_call>` block and the calls as OpenAI `tool_calls`."""
    calls = []
    for k, match in enumerate(TOOL_CALL.finditer(text)):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and "name" in call:
            calls.append({"id": f"call_{k}", "type": "function",
                          "function": {"name": str(call["name"]),
                                       "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls:
        return text, []
    head = text[:text.index("<tool_call>")].strip()
    return head or None, calls


class OpenAIServer:
    """The endpoint on `engine` (its tokenizer, its chat template), served from a thread of the calling process;
    `version()` gives the policy version the engine holds; `lock` is the one the engine's other users take."""

    def __init__(self, engine: Any, *, lock: threading.Lock, version: Any = lambda: 0, host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "looprl-policy"):
        self.engine, self.tok, self.version, self.model_name = engine, engine.tokenizer, version, model_name
        self.batcher = RequestBatcher(engine, lock)
        self.sessions: dict[str, Session] = {}
        self.sampling, self.max_episode_tokens = SamplingParams(), 1 << 30
        self.host, self.port = host, self._serve(host, port)

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def configure(self, sampling: SamplingParams, max_episode_tokens: int) -> None:
        """The recipe's sampling and episode budget, for the sessions opened from now on."""
        self.sampling, self.max_episode_tokens = dataclasses.replace(sampling, n=1), max_episode_tokens

    def open_session(self, seed: int = 0) -> str:
        sid = uuid.uuid4().hex
        self.sessions[sid] = Session(seed)
        return sid

    def close_session(self, sid: str) -> Session:
        return self.sessions.pop(sid)

    def base_url(self, sid: str) -> str:
        return f"{self.address}/sessions/{sid}/v1"

    # ------------------------------------------------------------------ the HTTP side
    def _serve(self, host: str, port: int) -> int:
        from aiohttp import web
        app = web.Application()
        for prefix in ("/sessions/{sid}/v1", "/v1"):
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._completions)
            app.router.add_get(f"{prefix}/models", self._models)
        app.router.add_post("/sessions/{sid}/reward", self._reward)
        app.router.add_get("/health", self._health)
        started: queue.Queue = queue.Queue()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            started.put(site._server.sockets[0].getsockname()[1])
            loop.run_forever()
        threading.Thread(target=serve, name="looprl-openai-server", daemon=True).start()
        return started.get(timeout=60)

    def _session(self, request: Any) -> tuple[str, Session]:
        from aiohttp import web
        sid = request.match_info.get("sid") or request.headers.get("X-Session-Id")
        if not sid:
            raise web.HTTPBadRequest(text="no session: use base_url .../sessions/<id>/v1 or an X-Session-Id header")
        if sid not in self.sessions:
            raise web.HTTPNotFound(text=f"unknown session {sid!r} (closed, or never opened by looprl)")
        return sid, self.sessions[sid]

    async def _health(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response({"ok": True, "sessions": len(self.sessions)})

    async def _models(self, request: Any) -> Any:
        from aiohttp import web
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "looprl"}]})

    async def _reward(self, request: Any) -> Any:
        from aiohttp import web
        _, session = self._session(request)
        body = await _json(request)
        if not isinstance(body.get("reward"), (int, float)):
            raise web.HTTPBadRequest(text='the body must be {"reward": <number>}')
        session.reward = float(body["reward"])
        return web.json_response({"ok": True})

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web
        _, session = self._session(request)
        body = await _json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise web.HTTPBadRequest(text="messages: a list of {role, content} objects")
        try:
            text = self._chat_text(session, messages, body.get("tools"))
        except SessionConflict as err:
            raise web.HTTPConflict(text=str(err)) from None
        session.messages = messages
        return await self._complete(session, text, None, body, chat=True)

    def _chat_text(self, session: Session, messages: list[dict], tools: Any) -> str:
        """The chat template's prompt. When it does not start with the session's text (the template renders the
        served reply otherwise than it was sampled, e.g. its tool calls), the messages after that reply are
        rendered alone and put after the session's text: the reply is kept as sampled."""
        render = self.tok.apply_chat_template
        text = render(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        if not session.versions or text.startswith(session.text):
            return text
        held = len(session.messages)
        if messages[:held] != session.messages or len(messages) <= held or messages[held]["role"] != "assistant":
            raise SessionConflict("the messages do not extend this session's conversation (its earlier messages "
                                  "and the reply served to them): open a new session for another conversation")
        served = render(messages[:held + 1], tools=tools, add_generation_prompt=False, tokenize=False)
        if not text.startswith(served):
            raise SessionConflict("the chat template renders these messages otherwise than the earlier ones: "
                                  "open a new session")
        return session.text + text[len(served):]

    async def _completions(self, request: Any) -> Any:
        from aiohttp import web
        _, session = self._session(request)
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self._complete(session, prompt, None, body, chat=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return await self._complete(session, None, prompt, body, chat=False)
        raise web.HTTPBadRequest(text="prompt: a string or a list of token ids (one prompt per request)")

    async def _complete(self, session: Session, text: str | None, ids: list[int] | None, body: dict,
                        chat: bool) -> Any:
        from aiohttp import web
        try:
            with session.lock:
                context, sp, seed = self._extend(session, text, ids, body)
        except SessionConflict as err:
            raise web.HTTPConflict(text=str(err)) from None
        except ValueError as err:
            raise web.HTTPBadRequest(text=str(err)) from None
        out, logp, ended = await asyncio.wrap_future(self.batcher.submit(context, sp, seed))
        version = self.version()
        with session.lock:
            append_action(session.episode, out, logp, len(session.versions))
            session.versions.append(version)
            session.text += self.tok.decode(out, skip_special_tokens=False)
        return web.json_response(self._response(context, out, logp, ended, version, body, chat))

    # ------------------------------------------------------------------ recording
    def _extend(self, session: Session, text: str | None, ids: list[int] | None, body: dict
                ) -> tuple[list[int], SamplingParams, int]:
        """Record the request's prompt on the session (the whole prompt on its first request, the part after the
        session's text as an observation afterwards); the context to generate from, the sampling and the seed."""
        e, tok = session.episode, self.tok
        if not session.versions:
            e.prompt_ids = list(ids) if ids is not None else tok(text, add_special_tokens=False)["input_ids"]
            session.text = text if text is not None else tok.decode(ids, skip_special_tokens=False)
        else:
            delta = self._delta(session, text, ids)
            e.ids += delta
            e.logp += [0.0] * len(delta)
            e.observation += [1] * len(delta)
            e.step += [-1] * len(delta)
        if not e.prompt_ids:
            raise ValueError("an empty prompt")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.sampling.max_new_tokens
        budget = min(int(asked), self.sampling.max_new_tokens, self.max_episode_tokens - len(e.ids))
        if budget < 1:
            raise ValueError(f"the episode's token budget is spent ({len(e.ids)} response tokens, "
                             f"rollout.max_episode_tokens {self.max_episode_tokens})")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        sp = dataclasses.replace(self.sampling, max_new_tokens=budget, stop=list(self.sampling.stop or []) + stop or None)
        # within torch.manual_seed's range (a signed 64-bit integer), whatever the run's seed and step
        return e.prompt_ids + e.ids, sp, (session.seed * 1_000_003 + len(session.versions) * 7919) % (1 << 63)

    def _delta(self, session: Session, text: str | None, ids: list[int] | None) -> list[int]:
        """The new prompt's ids after what the session holds; `SessionConflict` when it does not extend it."""
        e = session.episode
        if ids is not None:
            held = e.prompt_ids + e.ids
            if ids[:len(held)] != held:
                raise SessionConflict("the prompt's token ids do not start with this session's ids (prompt and "
                                      "every completion so far): open a new session for another conversation")
            delta = list(ids[len(held):])
            session.text += self.tok.decode(delta, skip_special_tokens=False)
            return delta
        if not text.startswith(session.text):
            raise SessionConflict("the prompt does not extend this session's conversation (its earlier prompt and "
                                  "the completions as served): open a new session for another conversation")
        added, session.text = text[len(session.text):], text
        return self.tok(added, add_special_tokens=False)["input_ids"] if added else []

    def _response(self, context: list[int], out: list[int], logp: list[float], ended: bool, version: int,
                  body: dict, chat: bool) -> dict:
        text = self.tok.decode(out, skip_special_tokens=True)
        finish = "stop" if ended else "length"
        choice: dict[str, Any] = {"index": 0, "token_ids": out, "logprobs": None}
        if chat:
            content, calls = parse_tool_calls(text)
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            finish = "tool_calls" if calls else finish
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [{"token": self.tok.decode([t]), "logprob": lp, "bytes": None,
                                                   "top_logprobs": []} for t, lp in zip(out, logp)]}
        else:
            choice["text"] = text
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [self.tok.decode([t]) for t in out], "token_logprobs": logp}
        choice["finish_reason"] = finish
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "prompt_token_ids": context,
                "policy_version": version,
                "usage": {"prompt_tokens": len(context), "completion_tokens": len(out),
                          "total_tokens": len(context) + len(out)}}


async def _json(request: Any) -> dict:
    from aiohttp import web
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="the body is not JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body
