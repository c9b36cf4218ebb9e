"""The same batch gives the same loss, gradient norm and update for any data-parallel size,
micro-batching and ZeRO stage (real DeepSpeed engines in Ray actors, gloo on CPU)."""

import pytest
import torch

from cluster.learner import LearnerGroup
from cluster.ray_utils import actor_env
from models.tiny import save_tiny
from rl.advantages import compute_grpo_advantages
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(save_tiny(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64))
    eng = HFEngine(path)
    batch = eng.generate(["12+3*4=", "5+6*7="], SamplingParams(n=4, max_new_tokens=12, seed=3))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    batch.advantages = compute_grpo_advantages(rewards, batch.group_id, batch.response_mask)
    # off-policy old logprobs so that the ratio and clipping are exercised
    batch.old_logp = batch.rollout_logp + 0.1 * torch.randn(batch.rollout_logp.shape,
                                                            generator=torch.Generator().manual_seed(0))
    return path, batch


def _train(path, batch, world_size, grad_accum, zero_stage, agg, loss="ppo_clip", params=None, max_tokens=0,
           pack=False, share_prompts=False):
    # AdamW with a large epsilon is close to SGD on the first step (update ~ lr * grad), so weight
    # differences measure gradient differences rather than Adam's sign-like normalisation.
    group = LearnerGroup(world_size, path, num_cpus=0.25, env=actor_env(), lr=1.0,
                         optimizer={"name": "adamw", "params": {"eps": 1.0}},
                         zero_stage=zero_stage,
                         micro_batch_size=max(1, len(batch) // world_size // grad_accum), grad_accum=grad_accum,
                         grad_clip=0.0, max_tokens_per_micro_batch=max_tokens, pack_sequences=pack,
                         share_prompts=share_prompts)
    try:
        m = group.train_step(batch, grad_accum, loss, {"agg": agg, **(params or {"eps_high": 0.28})})
        state = group.full_state_dict()
    finally:
        group.shutdown()
    return m, state


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token-mean",
                                 # across ranks also in CI through the token-budget test below
                                 pytest.param("seq-mean-token-mean", marks=pytest.mark.extended)])
def test_same_update_across_ranks_micro_batches_and_zero(ray_cluster, setup, agg):
    path, batch = setup
    ref_m, ref_state = _train(path, batch, 1, 1, 0, agg)
    # (2, 2, 3): micro-batches of uneven token counts on each of two ranks, so a count taken per micro-batch or per
    # rank, or a gradient scaled by the accumulation steps, shows; (1, 2, 1): a ZeRO optimizer on a single rank still
    # needs DeepSpeed's gradient reduction; two ranks without ZeRO: the token-budget test below
    configs = [(2, 2, 3), (1, 2, 1)] if agg == "token-mean" else [(2, 2, 0), (2, 1, 2)]
    for ws, ga, z in configs:
        m, state = _train(path, batch, ws, ga, z, agg)
        assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-6), (ws, ga, z)
        assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4), (ws, ga, z)
        for k, v in ref_state.items():
            assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-4), (ws, ga, z, k)
        assert any(not torch.equal(v, w) for v, w in zip(ref_state.values(), setup_initial(path).values()))


@pytest.mark.slow
def test_token_budget_micro_batches_packing_and_shared_prompts_give_the_same_update(ray_cluster, setup):
    """Micro-batches formed by token count (uneven row counts per micro-batch and rank), run padded, packed
    into one row, or with each prompt's forward shared by its rows (`share_prompts`, a prompt's rows kept in one
    micro-batch; padded, or packed: each prompt once in the row, `models.varlen_attention`): the loss, gradient
    norm and update equal the single full-batch step, for ZeRO 0 and 3."""
    from rl.batch import plan_micro_batches, plan_prompt_groups, sequence_tokens
    path, batch = setup
    plan = plan_micro_batches(sequence_tokens(batch), 2, 56)
    assert len(plan[0]) >= 2 and len({len(b) for bins in plan for b in bins}) > 1  # uneven micro-batches
    assert [len(bins) for bins in plan_prompt_groups(batch, 1, 48)] == [2]  # one prompt's 4 rows per micro-batch
    ref_m, ref_state = _train(path, batch, 1, 1, 0, "seq-mean-token-mean")
    # each layout once (padded: ZeRO 0 over two ranks; packed and packed+shared: ZeRO-3 over two ranks; shared
    # prompts padded: one rank, one prompt per micro-batch)
    for ranks, zero, layout, budget in [(2, 0, "padded", 56), (2, 3, "pack", 56), (1, 0, "share", 48),
                                        (2, 3, "pack+share", 56)]:
        m, state = _train(path, batch, ranks, 1, zero, "seq-mean-token-mean", max_tokens=budget,
                          pack=layout.startswith("pack"), share_prompts=layout.endswith("share"))
        case = (ranks, zero, layout)
        assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-6), case
        assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4), case
        for k, v in ref_state.items():
            assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-4), (*case, k)


_INITIAL = {}


def setup_initial(path):
    if path not in _INITIAL:
        from transformers import AutoModelForCausalLM
        _INITIAL[path] = AutoModelForCausalLM.from_pretrained(path).state_dict()
    return _INITIAL[path]


@pytest.mark.slow
# every loss reaches the learner through the same global-count aggregation (rl.losses.aggregate_loss); CI runs TGPO
# here, the extended suite GSPO and CISPO as well
@pytest.mark.parametrize("loss,params", [
    pytest.param("gspo", {"eps_low": 0.2, "eps_high": 0.2}, marks=pytest.mark.extended),
    pytest.param("cispo", {}, marks=pytest.mark.extended),
    ("tgpo", {"tau": 0.2, "eps_low": 0.2, "eps_high": 0.2}),
])
def test_every_loss_same_update_on_two_ranks_with_micro_batches(ray_cluster, setup, loss, params):
    path, batch = setup
    ref_m, ref_state = _train(path, batch, 1, 1, 0, "seq-mean-token-mean", loss, params)
    m, state = _train(path, batch, 2, 2, 0, "seq-mean-token-mean", loss, params)
    assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-6)
    assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4)
    assert ref_m["grad_norm"] > 0
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-4), k


# CI: LoRA through RL in tests/rl/test_lora.py, ZeRO-3 over two ranks in the token-budget test above
@pytest.mark.extended
@pytest.mark.slow
def test_a_lora_step_under_zero3_on_two_ranks_equals_the_single_rank_step(ray_cluster, setup):
    """LoRA (peft) with the base frozen and partitioned by ZeRO-3: token-budget micro-batches on two ranks, the
    output head projected 5 tokens at a time (so the ranks run different numbers of chunks, each gathering the
    frozen head once per forward and once per backward), an entropy bonus and a top-p nucleus: the loss,
    gradient norm and merged weights equal the one-rank ZeRO-0 step's, which recomputes the head by checkpoint;
    also with each prompt's forward shared by its rows (through the adapted model and its cache)."""
    path, batch = setup
    lora = {"name": "lora", "params": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    params = {"agg": "seq-mean-token-mean", "eps_high": 0.28, "entropy_coef": 0.01}
    results = []
    for world_size, zero, max_tokens, share in [(1, 0, 0, False), (2, 3, 56, False), (2, 3, 56, True)]:
        group = LearnerGroup(world_size, path, num_cpus=0.25, env=actor_env(), lr=1.0,
                             optimizer={"name": "adamw", "params": {"eps": 1.0}}, zero_stage=zero,
                             micro_batch_size=len(batch) // world_size, grad_accum=1, grad_clip=0.0,
                             max_tokens_per_micro_batch=max_tokens, logprob_chunk_tokens=5, adapter=lora,
                             share_prompts=share)
        try:
            m = group.train_step(batch, 1, "ppo_clip", params, need_entropy=True, top_p=0.9)
            results.append((m, group.full_state_dict()))
        finally:
            group.shutdown()
    (ref_m, ref_state), *others = results
    assert ref_m["grad_norm"] > 0
    initial = setup_initial(path)
    moved = {k for k, v in ref_state.items() if not torch.equal(v, initial[k])}
    assert moved == {f"model.layers.{i}.{m}.weight" for i in (0, 1)
                     for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    for case, (m, state) in zip(["zero3", "zero3 shared prompts"], others):
        assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-6), case
        assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4), case
        for k, v in ref_state.items():
            assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-4), (case, k)


@pytest.fixture(scope="module")
def long_batch(setup):
    """Responses of up to 48 tokens after prompts of different lengths (left-padded), off-policy old logprobs."""
    path, _ = setup
    batch = HFEngine(path).generate(["12+3*4=", "5+6*7-8*9+1=", "3=", "77*2+1="],
                                    SamplingParams(n=2, max_new_tokens=48, seed=5))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    batch.advantages = compute_grpo_advantages(rewards, batch.group_id, batch.response_mask)
    batch.old_logp = batch.rollout_logp + 0.1 * torch.randn(batch.rollout_logp.shape,
                                                            generator=torch.Generator().manual_seed(1))
    return batch


def _sequence_parallel_steps(path, long_batch, cases):
    """Each case's (logprobs, train-step metrics, full state) from a fresh learner group: `(name, world size,
    sequence-parallel size, ZeRO stage, adapter)`."""
    params = {"agg": "seq-mean-token-mean", "eps_high": 0.28, "entropy_coef": 0.01}
    results = {}
    for case, world, sp, zero, adapter in cases:
        group = LearnerGroup(world, path, num_cpus=0.25, env=actor_env(), lr=1.0,
                             optimizer={"name": "adamw", "params": {"eps": 1.0}}, zero_stage=zero,
                             micro_batch_size=4, grad_accum=2, grad_clip=0.0, attn_implementation="sdpa",
                             sequence_parallel_size=sp, adapter=adapter)
        try:
            logp = group.compute_logprobs(long_batch)
            m = group.train_step(long_batch, 2, "ppo_clip", params, need_entropy=True)
            results[case] = (logp, m, group.full_state_dict())
        finally:
            group.shutdown()
    return results


def _assert_same_step(results, pairs):
    for ref, case in pairs:
        (ref_logp, ref_m, ref_state), (logp, m, state) = results[ref], results[case]
        assert torch.allclose(logp, ref_logp, atol=1e-5), case
        assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-6), case
        assert m["entropy"] == pytest.approx(ref_m["entropy"], rel=1e-5), case
        assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4), case
        assert ref_m["grad_norm"] > 0
        for k, v in ref_state.items():
            assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-4), (case, k)


@pytest.mark.slow
def test_sequence_parallel_ranks_give_the_single_rank_loss_gradient_and_update(ray_cluster, setup, long_batch):
    """Ulysses sequence parallelism (DeepSpeed's ALST attention over gloo): two ranks each running half of every
    sequence's positions give the one-rank step's logprobs, loss, gradient norm and updated weights, with a
    sequence-level loss aggregation (every rank computes it from the gathered logprobs), an entropy bonus, under
    ZeRO-3 (the partitioned weights gathered around the exchange; without ZeRO, sequence-parallel logprobs equal the
    rollout engine's in the DAPO/GSPO variant of tests/cluster/test_pipeline.py)."""
    path, _ = setup
    results = _sequence_parallel_steps(path, long_batch, [("one", 1, 1, 0, None), ("sp2-z3", 2, 2, 3, None)])
    _assert_same_step(results, [("one", "sp2-z3")])
    mask = long_batch.response_mask.bool()
    assert mask.sum(-1).max() > 24  # responses long enough that each rank holds response tokens


@pytest.mark.extended  # CI: sequence parallelism and a LoRA step on two ranks (ZeRO-3) in the tests above
@pytest.mark.slow
def test_sequence_parallel_ranks_give_the_single_rank_step_with_a_lora_adapter(ray_cluster, setup, long_batch):
    """The same with a LoRA adapter on the attention and MLP projections."""
    path, _ = setup
    lora = {"name": "lora", "params": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    results = _sequence_parallel_steps(path, long_batch, [("one-lora", 1, 1, 0, lora), ("sp2-lora", 2, 2, 0, lora)])
    _assert_same_step(results, [("one-lora", "sp2-lora")])


@pytest.mark.extended  # CI: sequence parallelism on the Llama family above
@pytest.mark.slow
def test_sequence_parallel_ranks_give_a_looped_models_single_rank_step(ray_cluster, tmp_path, long_batch):
    """A looped model (Ouro: its own attention, DeepSpeed's Ulysses exchange around each layer's sdpa call):
    every loop's logprobs, the exit pdf, RLTT's loss, gradient norm and updated weights of two sequence-parallel
    ranks equal the one-rank step's."""
    path = str(save_tiny(tmp_path / "ouro", arch="ouro", loops=3, hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64))
    params = {"agg": "token-mean", "loop_weighting": "exit_pdf"}
    results = {}
    for world, sp in [(1, 1), (2, 2)]:
        group = LearnerGroup(world, path, num_cpus=0.25, env=actor_env(), lr=1.0, family="looped",
                             optimizer={"name": "adamw", "params": {"eps": 1.0}}, micro_batch_size=4, grad_accum=2,
                             grad_clip=0.0, attn_implementation="sdpa", sequence_parallel_size=sp)
        try:
            outs = [group.compute_logprobs(long_batch, output=o) for o in ("loop_logp", "exit_pdf")]
            m = group.train_step(long_batch, 2, "rltt", params)
            results[sp] = (outs, m, group.full_state_dict())
        finally:
            group.shutdown()
    (ref_outs, ref_m, ref_state), (outs, m, state) = results[1], results[2]
    mask = long_batch.response_mask.bool()  # past a response's end the one-rank forward reads padding
    for a, b in zip(outs, ref_outs):
        assert a.shape[-1] == 3 and torch.allclose(a[mask], b[mask], atol=1e-5)
    assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-6)
    assert m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4) and ref_m["grad_norm"] > 0
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-4), k
