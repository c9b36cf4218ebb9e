"""Partial rollouts (`rl.loop.partial`) on a real hf engine: responses grown over several steps equal the ones
generated in one go, finished groups are trained first, and every token keeps the version that sampled it."""

import torch
from omegaconf import OmegaConf

from rl import config
from rl.data import PromptSampler
from rl.loop.partial import PartialRollouts
from rollout.base import SamplingParams

ROWS = [{"prompt": f"{a}+{a}*{a}=", "answer": str(a + a * a)} for a in range(1, 9)]


class EngineRoles:
    """The one method of the actor system partial rollouts call, served in-process by a real engine (a harness: the
    Ray side is `cluster.rl_roles.continue_responses`, run end to end in tests/cluster/test_pipeline.py)."""

    def __init__(self, engine, sampling):
        self.engine, self.sampling, self.version, self.calls = engine, sampling, 0, 0

    def continue_responses(self, contexts, max_new_tokens, seed):
        self.calls += 1
        sp = SamplingParams(**{**self.sampling, "max_new_tokens": max(max_new_tokens)})
        outs = self.engine.generate_ids(contexts, sp, seeds=[seed + i for i in range(len(contexts))])
        return [(o.ids, o.logprobs, o.ended, self.version) for o in outs]


def _pool(engine, partial_tokens, max_new_tokens=24, temperature=0.0, stop=None):
    cfg = config.load(None, [f"rollout.partial_tokens={partial_tokens}", f"rollout.max_new_tokens={max_new_tokens}",
                             "rollout.n=2", "trainer.prompts_per_step=2", f"rollout.temperature={temperature}"])
    roles = EngineRoles(engine, {"n": 1, "temperature": temperature, "stop": stop})
    return PartialRollouts(cfg, engine.tokenizer, roles, PromptSampler(len(ROWS), 0, shuffle=False), ROWS), roles


def _responses(batch):
    return {(m["row"], i % 2): batch.response_ids[i][batch.response_attn[i].bool()].tolist()
            for i, m in enumerate(batch.metadata)}


def test_responses_grown_in_pieces_equal_the_ones_generated_at_once(engine):
    """Greedy: a response continued 5 tokens at a time from its own ids is the response generated in one call,
    token for token, with the same logprobs; a group with a longer response waits for it."""
    whole, _ = _pool(engine, partial_tokens=24)
    pieces, roles = _pool(engine, partial_tokens=5)
    reference = {}
    for _ in range(4):
        batch, _ = whole.next_batch(0)
        reference.update({k: (v, batch) for k, v in _responses(batch).items()})
    seen = {}
    for step in range(6):
        roles.version = step
        batch, metrics = pieces.next_batch(step)
        assert metrics["rollout/partial_rounds"] >= 0 and batch.response_attn.sum() > 0
        for key, ids in _responses(batch).items():
            seen[key] = ids
            ref_ids, ref_batch = reference.get(key, (None, None))
            if ref_ids is not None:
                assert ids == ref_ids, key
        versions = batch.extras["token_version"].value[batch.response_attn.bool()]
        assert batch.policy_version == int(versions.min()) and int(versions.max()) <= step
    assert len(seen.keys() & reference.keys()) >= 6
    assert any(len(v) > 5 for v in seen.values())  # some responses did span several rounds


def test_a_long_response_carries_its_tokens_versions_across_steps(engine):
    """Stop strings give the responses lengths of every size: the short groups are trained while a long response
    waits in the pool and goes on after the update."""
    pool, roles = _pool(engine, partial_tokens=3, temperature=1.0, stop=list("0123456789"))
    spans = []
    for step in range(5):
        roles.version = step
        batch, metrics = pool.next_batch(step)
        versions = batch.extras["token_version"].value
        for i in range(len(batch)):
            n = int(batch.response_attn[i].sum())
            row = versions[i, :n].tolist()
            assert row == sorted(row)  # a response's later tokens are of the same or newer versions
            spans.append(len(set(row)))
        assert (batch.group_id.view(-1, 2)[:, 0] == batch.group_id.view(-1, 2)[:, 1]).all()  # groups kept whole
    assert max(spans) > 1  # some response was continued after an update


def test_the_pool_resumes_from_its_saved_state(engine):
    first, roles = _pool(engine, partial_tokens=4, temperature=1.0)
    first.next_batch(0)
    saved = OmegaConf.to_container(OmegaConf.create(first.state()))  # JSON-like, as the checkpoint stores it
    sampler_state = first.sampler.state()
    expected, _ = first.next_batch(1)
    again, _ = _pool(engine, partial_tokens=4, temperature=1.0)
    again.load(saved)
    again.sampler.load(sampler_state)
    resumed, _ = again.next_batch(1)
    assert torch.equal(resumed.response_ids, expected.response_ids)
    assert torch.equal(resumed.extras["token_version"].value, expected.extras["token_version"].value)
