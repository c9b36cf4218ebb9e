"""The learner runs a family's forward and an injected loss: optimizers named in the recipe (a forward-only
MeZO among them), batch extras reaching a loss, on real DeepSpeed engines in Ray actors (gloo on CPU)."""

import pytest
import torch

from cluster.learner import LearnerGroup
from cluster.ray_utils import actor_env
from models.tiny import save_tiny
from models.tokenizer import load_tokenizer
from rl.advantages import compute_grpo_advantages
from rl.sft_data import make_sft_batch
from rollout.base import SamplingParams
from rollout.hf_engine import HFEngine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64))


def _sft_batch(path, n=16):
    tok = load_tokenizer(path)
    prompts = [f"{a}+{b}*{c}=" for a, b, c in zip(range(1, n + 1), range(2, n + 2), range(3, n + 3))]
    return make_sft_batch(tok, prompts, [f"{b}*{c}={b * c}" for b, c in zip(range(2, n + 2), range(3, n + 3))])


def _nll(group, batch):
    logp = group.compute_logprobs(batch)
    return float(-(logp * batch.response_mask).sum() / batch.response_mask.sum())


def _group(path, world_size, grad_accum, batch, **kw):
    return LearnerGroup(world_size, path, num_cpus=0.25, env=actor_env(), grad_accum=grad_accum,
                        micro_batch_size=len(batch) // world_size // grad_accum, grad_clip=0.0, **kw)


MEZO = {"name": "mezo", "params": {"eps": 1e-3, "seed": 3}}


@pytest.mark.slow
def test_mezo_lowers_the_sft_loss_with_no_backward_pass_and_two_ranks_take_the_same_step(ray_cluster, tiny):
    batch = _sft_batch(tiny)
    one = _group(tiny, 1, 2, batch, lr=5e-3, optimizer=MEZO)
    try:
        before = _nll(one, batch)
        history = [one.sft_step(batch, 2) for _ in range(10)]
        one_state = one.full_state_dict()  # after 10 steps: what two ranks must reach
        history += [one.sft_step(batch, 2) for _ in range(20)]
        after = _nll(one, batch)
        counters = one.counters()
    finally:
        one.shutdown()
    assert [c["backward_passes"] for c in counters] == [0]
    assert after < before - 0.05, (before, after)
    assert all(h["grad_norm"] != h["grad_norm"] for h in history)  # NaN: no gradient exists

    two = _group(tiny, 2, 1, batch, lr=5e-3, optimizer=MEZO)
    try:
        for _ in range(10):
            two.sft_step(batch, 1)
        two_state = two.full_state_dict()
        assert [c["backward_passes"] for c in two.counters()] == [0, 0]
    finally:
        two.shutdown()
    for k, v in one_state.items():
        assert torch.allclose(two_state[k], v, atol=1e-5), k


@pytest.mark.extended  # CI: MeZO's step above
@pytest.mark.slow
def test_mezo_needs_zero_stage_0(ray_cluster, tiny):
    batch = _sft_batch(tiny)
    with pytest.raises(Exception, match="forward-only.*zero_stage 0"):
        _group(tiny, 1, 1, batch, lr=1e-3, optimizer=MEZO, zero_stage=1)


def weighted_pg_loss(logp, old_logp, advantages, response_mask, *, token_weight, num_tokens, **_):
    """A policy-gradient loss that reads a per-token batch extra."""
    return -(token_weight * advantages * logp * response_mask).sum() / num_tokens, {}


@pytest.mark.slow
def test_a_batch_extra_reaches_the_loss_and_splits_across_ranks_and_micro_batches(ray_cluster, tiny):
    eng = HFEngine(tiny)
    batch = eng.generate(["12+3*4=", "5+6*7="], SamplingParams(n=4, max_new_tokens=10, seed=5))
    batch.advantages = compute_grpo_advantages(torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 1]), batch.group_id,
                                               batch.response_mask)
    weight = torch.linspace(0.0, 2.0, batch.response_ids.shape[1]).expand(len(batch), -1).contiguous()
    batch.set_extra("token_weight", weight, pad="right")
    spec = f"{__file__}:weighted_pg_loss"

    def train(world_size, grad_accum, b):
        group = _group(tiny, world_size, grad_accum, b, lr=1.0, optimizer={"name": "adamw", "params": {"eps": 1.0}})
        try:
            m = group.train_step(b, grad_accum, spec, {})
            return m, group.full_state_dict()
        finally:
            group.shutdown()

    ref_m, ref_state = train(1, 1, batch)
    m, state = train(2, 2, batch)
    assert m["loss"] == pytest.approx(ref_m["loss"], abs=1e-6)
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-4), k
    # the loss by hand from the engine's logprobs of its own samples (the learner's agree to ~1e-5 on-policy): the
    # weights entered it, and without them it would differ by far more than that agreement
    mask = batch.response_mask
    by_hand = float(-(weight * batch.advantages * batch.rollout_logp * mask).sum() / mask.sum())
    unweighted = float(-(batch.advantages * batch.rollout_logp * mask).sum() / mask.sum())
    assert ref_m["loss"] == pytest.approx(by_hand, abs=1e-4)
    assert abs(by_hand - unweighted) > 1e-2


@pytest.mark.slow
def test_the_reference_is_partitioned_under_zero3_and_gives_the_unsharded_logprobs(ray_cluster, tiny):
    """Under ZeRO-3 each rank holds half of the frozen reference, not a full copy; its logprobs (under a
    top-p nucleus, token-budget micro-batches) equal the model's computed in one piece."""
    from models.families import response_logprobs
    eng = HFEngine(tiny)
    batch = eng.generate(["12+3*4=", "5+6*7=", "9-2="], SamplingParams(n=4, max_new_tokens=10, seed=1, top_p=0.9))
    with torch.no_grad():
        expected, _ = response_logprobs(eng.model, batch, top_p=0.9)
    total = sum(p.numel() for p in eng.model.parameters())
    group = _group(tiny, 2, 1, batch, lr=1e-3, zero_stage=3, with_ref=True, max_tokens_per_micro_batch=40)
    try:
        ref = group.compute_logprobs(batch, "ref", top_p=0.9)
        held = group.counters()
    finally:
        group.shutdown()
    assert torch.allclose(ref, expected, atol=1e-5)
    for rank in held:  # ZeRO-3 pads partitions: at most a few elements over half per parameter
        assert total / 2 <= rank["ref_numel"] < total / 2 + 1000 and rank["policy_numel"] == rank["ref_numel"]


# CI: the looped model's learner under RLTT (tests/cluster/test_pipeline.py)
@pytest.mark.extended
@pytest.mark.slow
def test_sft_of_every_loop_readout_trains_the_early_exits(ray_cluster, tmp_path):
    """`sft.loop_readouts: all` on a looped model: the loss is the NLL averaged over every loop's readout (the
    final loop's alone by default), and after the same steps the loop-1 readout has learned more."""
    path = str(save_tiny(tmp_path / "looped", arch="ouro", loops=3, hidden_size=32, num_layers=1, num_heads=2,
                         intermediate_size=64))
    batch = _sft_batch(path)

    def per_loop_nll(group):
        loop_logp = group.compute_logprobs(batch, output="loop_logp")
        mask = batch.response_mask.unsqueeze(-1)
        return (-(loop_logp * mask).sum((0, 1)) / mask.sum()).tolist()

    results = {}
    for readouts in ("final", "all"):
        group = _group(path, 1, 1, batch, lr=5e-3, family="looped")
        try:
            before = per_loop_nll(group)
            first = group.sft_step(batch, 1, loop_readouts=readouts)["loss"]  # computed before the update
            for _ in range(19):
                group.sft_step(batch, 1, loop_readouts=readouts)
            results[readouts] = (before, first, per_loop_nll(group))
        finally:
            group.shutdown()
    (before, first_final, after_final), (_, first_all, after_all) = results["final"], results["all"]
    assert first_final == pytest.approx(before[-1], abs=1e-5)
    assert first_all == pytest.approx(sum(before) / 3, abs=1e-5)
    assert after_final[-1] < before[-1] - 1.0 and after_all[-1] < before[-1] - 1.0  # both learn the final readout
    assert after_all[0] < after_final[0], results  # loop 1 learns more when it is trained


def _attention_kernels(worker) -> dict[str, str]:
    import ray
    return ray.get(worker.__ray_call__.remote(
        lambda self: {"policy": self.strategy.engine.module.config._attn_implementation,
                      "ref": self.strategy.ref.config._attn_implementation}))


# CI: sdpa chosen by the recipe in the DAPO/GSPO variant (tests/cluster/test_pipeline.py), the packed kernel in the
# token-budget invariance
@pytest.mark.extended
def test_the_learner_attention_kernel_is_chosen_by_the_recipe_and_trains_the_same_model(ray_cluster, tiny):
    """`learner.attn_implementation` loads the policy and the reference with that kernel; eager and sdpa compute
    the same logprobs and take the same step (float rounding apart)."""
    batch = _sft_batch(tiny)
    results = {}
    for kernel in ("sdpa", "eager"):
        group = _group(tiny, 1, 2, batch, lr=1e-2, with_ref=True, attn_implementation=kernel)
        try:
            results[kernel] = {"kernels": _attention_kernels(group.workers[0]),
                               "before": group.compute_logprobs(batch), "step": group.sft_step(batch, 2),
                               "after": group.compute_logprobs(batch), "ref": group.compute_logprobs(batch, "ref")}
        finally:
            group.shutdown()
    assert results["eager"]["kernels"] == {"policy": "eager", "ref": "eager"}
    assert results["sdpa"]["kernels"] == {"policy": "sdpa", "ref": "sdpa"}
    s, e = results["sdpa"], results["eager"]
    assert torch.allclose(s["before"], e["before"], atol=1e-5)
    assert torch.allclose(s["ref"], e["ref"], atol=1e-5)
    assert abs(s["step"]["grad_norm"] - e["step"]["grad_norm"]) < 1e-4 * s["step"]["grad_norm"]
    assert not torch.allclose(s["before"], s["after"], atol=1e-3)  # the step moved the model ...
    assert torch.allclose(s["after"], e["after"], atol=1e-4)  # ... to the same place under both kernels


def _compiled_modules(group) -> dict:
    """What the learner rank compiled: the names of its modules that run compiled, and whether the Llama modeling
    module's rotary embedding is the compiled one."""
    import ray
    worker = group.workers[0]
    return {"compiled": ray.get(worker.__ray_call__.remote(
                lambda self: sorted(name for name, m in self.strategy.engine.module.named_modules()
                                    if getattr(m, "_compiled_call_impl", None) is not None))),
            "rotary": ray.get(worker.__ray_call__.remote(
                lambda self: getattr(__import__("transformers.models.llama.modeling_llama", fromlist=["x"])
                                     .apply_rotary_pos_emb, "looprl_compiled", False)))}


def test_the_learner_compiles_the_modules_that_compile_position_wise_names(ray_cluster, tiny):
    """`learner.compile_position_wise` with packed rows and shared prompts: the learner rank compiles each decoder
    layer whole and the final norm, and leaves the rotary embedding to the layers' graphs. Checked before any
    forward (torch.compile compiles on the first call): that the compiled modules compute what the eager ones do
    is tested on the model (tests/models/test_varlen_attention.py, tests/models/test_blocks.py) and, in the
    learner, by the extended test below."""
    group = _group(tiny, 1, 2, _sft_batch(tiny), lr=1e-2, compile_position_wise=True, pack_sequences=True,
                   share_prompts=True)
    try:
        assert _compiled_modules(group) == {"compiled": ["model.layers.0", "model.layers.1", "model.norm"],
                                            "rotary": False}
    finally:
        group.shutdown()


# CI: the learner's compiled modules above, their numbers on the model (tests/models/test_varlen_attention.py,
# tests/models/test_blocks.py); here the learner's step with them, against the eager learner's
@pytest.mark.extended
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_position_wise_modules_train_the_same_model(ray_cluster, tiny, packed):
    """`learner.compile_position_wise`: every decoder layer's MLP and norms, the final norm, and the rotary embedding
    its attention applies, run compiled (inductor) in the learner; with packed rows and shared prompts each decoder
    layer compiles whole instead (`models.blocks.compile_decoder_layers`); logprobs, the step's gradient norm and the
    model after it equal the eager learner's (float rounding apart)."""
    batch = _sft_batch(tiny)
    results = {}
    for compiled in (False, True):
        group = _group(tiny, 1, 2, batch, lr=1e-2, compile_position_wise=compiled, pack_sequences=packed,
                       share_prompts=packed)
        try:
            results[compiled] = {**_compiled_modules(group), "before": group.compute_logprobs(batch),
                                 "step": group.sft_step(batch, 2), "after": group.compute_logprobs(batch)}
        finally:
            group.shutdown()
    eager, fused = results[False], results[True]
    assert eager["compiled"] == [] and not eager["rotary"]
    if packed:  # the layers whole (their rotary embedding inside the graph) and the final norm
        assert fused["compiled"] == ["model.layers.0", "model.layers.1", "model.norm"] and not fused["rotary"]
    else:
        assert fused["rotary"]  # the learner's process applies the compiled rotary embedding
        assert fused["compiled"] == [f"model.layers.{i}.{m}" for i in range(2)
                                     for m in ("input_layernorm", "mlp", "post_attention_layernorm")] + ["model.norm"]
    assert torch.allclose(eager["before"], fused["before"], atol=1e-5)
    assert abs(eager["step"]["grad_norm"] - fused["step"]["grad_norm"]) < 1e-4 * eager["step"]["grad_norm"]
    assert not torch.allclose(eager["before"], eager["after"], atol=1e-3)  # the step moved the model ...
    assert torch.allclose(eager["after"], fused["after"], atol=1e-4)  # ... to the same place either way


def test_the_looped_family_refuses_another_attention_kernel(tmp_path):
    from models.families import LoopedFamily
    path = save_tiny(tmp_path, arch="ouro", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match="attn_implementation 'eager'.*looped"):
        LoopedFamily().load(str(path), attn_implementation="eager")
    assert LoopedFamily().load(str(path), attn_implementation="sdpa") is not None


@pytest.mark.slow
def test_a_masked_diffusion_sft_step_is_the_same_on_two_ranks_as_in_two_micro_batches(ray_cluster, tmp_path):
    """The MDLM loss through the same learner: each row's noise is seeded by its `noise_seed` extra, so the update
    does not depend on where the row is computed; the loss is normalised by the global response-token count."""
    path = str(save_tiny(tmp_path / "llada", arch="llada", hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64))
    batch = _sft_batch(path)
    batch.set_extra("noise_seed", torch.arange(len(batch)) + 100)

    def step(world_size, grad_accum):
        # AdamW with eps 1 takes a step proportional to the gradient, so equal gradients show as equal weights
        group = _group(path, world_size, grad_accum, batch, lr=1.0, family="masked_diffusion",
                       optimizer={"name": "adamw", "params": {"eps": 1.0}})
        try:
            before = group.full_state_dict()
            metrics = group.sft_step(batch, grad_accum)
            return metrics, before, group.full_state_dict()
        finally:
            group.shutdown()
    one, start, one_state = step(1, 4)  # micro-batches of 4 rows
    two, _, two_state = step(2, 1)  # two ranks of 8 rows
    from transformers import AutoModel

    from models.families import masked_token_logp
    with torch.no_grad():  # the MDLM loss of the whole batch in one process
        terms = masked_token_logp(AutoModel.from_pretrained(path), batch)
    assert one["loss"] == pytest.approx(float(-terms.sum() / batch.response_mask.sum()), rel=1e-5)
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5) and one["loss"] > 0
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-4)
    for k, v in one_state.items():
        assert torch.allclose(two_state[k], v, atol=1e-6), k
    assert any(not torch.equal(start[k], one_state[k]) for k in start)  # the step moved the weights


def test_a_teacher_with_another_vocabulary_is_refused_naming_the_key(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from cluster.learner.strategy import check_teacher
    policy = AutoModelForCausalLM.from_pretrained(tiny)
    check_teacher(policy, AutoModelForCausalLM.from_pretrained(tiny), tiny)  # the same tokenizer: accepted
    other = save_tiny(tmp_path / "other", added_tokens=["<tool>", "</tool>"], hidden_size=32, num_layers=1,
                      num_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match=r"algorithm.teacher_path .*other: a vocabulary of \d+ tokens"):
        check_teacher(policy, AutoModelForCausalLM.from_pretrained(other), str(other))
