import math

import pytest
import torch

from rl.losses import aggregate_loss, kl_penalty, ppo_clip_loss
from rl.registry import lookup


def _ratio_inputs(ratios, advs):
    old = torch.zeros(1, len(ratios))
    logp = torch.log(torch.tensor([ratios], dtype=torch.float32))
    return logp, old, torch.tensor([advs], dtype=torch.float32), torch.ones(1, len(ratios))


def _assert_same_loss_and_grad(loss_a, loss_b, logp, atol):
    """`loss_a(logp)` and `loss_b(logp)` give the same loss and the same gradient w.r.t. `logp`;
    returns loss_a's metrics and gradient for further checks."""
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    la, metrics = loss_a(a)
    lb, _ = loss_b(b)
    la.backward()
    lb.backward()
    assert la.item() == pytest.approx(lb.item(), abs=atol)
    assert torch.allclose(a.grad, b.grad, atol=atol)
    return metrics, a.grad


def test_ppo_clip_hand_value():
    # ratios 0.5/1.0/1.5, advantages [1,-1,2], eps 0.2 -> per-token [-0.5, 1.0, -2.4], mean -0.63333
    logp, old, adv, mask = _ratio_inputs([0.5, 1.0, 1.5], [1.0, -1.0, 2.0])
    loss, m = ppo_clip_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-0.633333, abs=1e-5)
    assert m["clipfrac"] == pytest.approx(1 / 3)


def test_clip_higher_uses_separate_bounds():
    # A>0, r=1.25: eps_high 0.28 keeps r unclipped (-1.25); eps_high 0.2 clips to -1.2
    logp, old, adv, mask = _ratio_inputs([1.25], [1.0])
    assert ppo_clip_loss(logp, old, adv, mask, eps_high=0.28)[0].item() == pytest.approx(-1.25, abs=1e-6)
    assert ppo_clip_loss(logp, old, adv, mask, eps_high=0.2)[0].item() == pytest.approx(-1.2, abs=1e-6)
    # A<0, r=0.7: eps_low 0.2 clips to 0.8 -> max(0.7, 0.8) = 0.8
    logp, old, adv, mask = _ratio_inputs([0.7], [-1.0])
    assert ppo_clip_loss(logp, old, adv, mask, eps_low=0.2)[0].item() == pytest.approx(0.8, abs=1e-6)


def test_dual_clip_hand_value():
    # advantages [1,-1,-4], ratios [0.5,1,10], eps 0.2, c 3 -> per-token [-0.5, 1.0, 12.0], sum 12.5
    logp, old, adv, mask = _ratio_inputs([0.5, 1.0, 10.0], [1.0, -1.0, -4.0])
    loss, _ = ppo_clip_loss(logp, old, adv, mask, dual_clip=3.0, agg="token-mean", num_tokens=1.0)
    assert loss.item() == pytest.approx(12.5, abs=1e-4)
    loss_nodual, _ = ppo_clip_loss(logp, old, adv, mask, agg="token-mean", num_tokens=1.0)
    assert loss_nodual.item() == pytest.approx(-0.5 + 1.0 + 40.0, abs=1e-3)


def test_dual_clip_must_exceed_one():
    logp, old, adv, mask = _ratio_inputs([1.0], [-1.0])
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, old, adv, mask, dual_clip=0.5)


def test_kl_estimators_table():
    # logp = -1 against ref [0, -15, -30]
    logp = torch.full((3,), -1.0)
    ref = torch.tensor([0.0, -15.0, -30.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([-1.0, 14.0, 29.0]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 98.0, 420.5]))
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.tensor([math.e - 2, 13.0, 28.0]), atol=1e-4)
    # rl/methods/rltt/README.md: ref -1.0, policy -1.2 -> k3 = e^0.2 - 0.2 - 1
    assert kl_penalty(torch.tensor(-1.2), torch.tensor(-1.0), "k3").item() == pytest.approx(0.0214028, abs=1e-6)
    assert kl_penalty(torch.tensor(-1.0), torch.tensor(-1.0), "k3").item() == 0.0
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_kl_in_loss_adds_coef_times_kl():
    logp = torch.tensor([[-1.2, -1.2]])
    old = logp.clone()
    adv = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    loss, m = ppo_clip_loss(logp, old, adv, mask, ref_logp=torch.tensor([[-1.0, -1.0]]), kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 * 0.0214028, abs=1e-6)
    assert m["kl"] == pytest.approx(0.0214028, abs=1e-6)
    with pytest.raises(ValueError, match="ref"):
        ppo_clip_loss(logp, old, adv, mask, kl_coef=0.5)


def test_entropy_bonus_is_subtracted():
    z = torch.zeros(1, 2)
    loss, _ = ppo_clip_loss(z, z, z, torch.ones(1, 2), entropy=torch.tensor([[2.0, 4.0]]), entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.3)


def _two_sequences():
    # rl/methods/rltt/README.md aggregation case: A has 1 token (Â +1), B has 3 tokens (Â -1), all logp -1;
    # per-token REINFORCE value -Â·logp
    values = torch.tensor([[1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    return values, mask


def test_aggregation_modes_hand_values():
    v, m = _two_sequences()
    assert aggregate_loss(v, m, "token-mean").item() == pytest.approx(-0.5)
    assert aggregate_loss(v, m, "seq-mean-token-mean").item() == pytest.approx(0.0)
    assert aggregate_loss(v, m, "seq-mean-token-sum-norm").item() == pytest.approx((1 - 3) / (2 * 3))
    assert aggregate_loss(v, m, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(-2 / 8)
    with pytest.raises(ValueError):
        aggregate_loss(v, m, "sum")


def test_fully_masked_sequence_not_counted():
    v = torch.tensor([[2.0, 2.0], [5.0, 5.0]])
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert aggregate_loss(v, m, "seq-mean-token-mean").item() == pytest.approx(2.0)


def test_ppo_clip_gradient_on_policy_is_reinforce():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.5, 0.5]])
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, torch.ones(1, 2))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25]]))


def test_registered():
    assert lookup("loss", "ppo_clip") is ppo_clip_loss


def test_kl_in_reward_hand_value():
    rewards = torch.tensor([1.0, 0.0])
    logp = torch.tensor([[-1.2, -1.2, 0.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.0, -1.0, -5.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    from rl.losses import kl_in_reward
    penalised, seq_kl = kl_in_reward(rewards, logp, ref, mask, coef=0.5, estimator="k1")
    assert torch.allclose(seq_kl, torch.tensor([-0.4, 0.0]))  # k1 = logp - ref, masked token ignored
    assert torch.allclose(penalised, torch.tensor([1.2, 0.0]))
    penalised3, _ = kl_in_reward(rewards, logp, ref, mask, coef=1.0, estimator="k3")
    assert penalised3[0].item() == pytest.approx(1.0 - 2 * 0.0214028, abs=1e-6)


def test_gspo_sequence_ratio_hand_values():
    from rl.losses import gspo_loss
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    # token log-ratios [0.1, -0.1, 0.3] -> log s = 0.1, s = 1.105171
    logp = torch.tensor([[0.1, -0.1, 0.3]], requires_grad=True)
    loss, m = gspo_loss(logp, old, torch.ones(1, 3), mask)
    assert loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-6)  # A>0: clipped at 1 + eps_high
    assert m["seq_ratio_mean"] == pytest.approx(1.105171, abs=1e-6) and m["clipfrac"] == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 3))  # clipped: no gradient
    logp2 = torch.tensor([[0.1, -0.1, 0.3]], requires_grad=True)
    loss2, _ = gspo_loss(logp2, old, -torch.ones(1, 3), mask)
    assert loss2.item() == pytest.approx(1.105171, abs=1e-6)  # A<0: the unclipped branch is larger
    loss2.backward()
    assert torch.allclose(logp2.grad, torch.full((1, 3), 1.105171 / 3), atol=1e-6)


def test_gspo_token_equals_gspo_with_sequence_advantages():
    from rl.losses import gspo_loss, gspo_token_loss
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 5, generator=g) * 0.01 - 1
    base = old + torch.randn(4, 5, generator=g) * 0.01
    adv = torch.randn(4, 1, generator=g).expand(4, 5).clone()
    mask = (torch.rand(4, 5, generator=g) > 0.2).float()
    mask[:, 0] = 1
    _assert_same_loss_and_grad(lambda x: gspo_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.2),
                               lambda x: gspo_token_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.2), base, 1e-7)


def test_gspo_on_policy_equals_ppo_clip_seq_mean():
    from rl.losses import gspo_loss
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[0.7] * 3, [-0.4] * 3])
    _assert_same_loss_and_grad(lambda x: gspo_loss(x, logp, adv, mask),
                               lambda x: ppo_clip_loss(x, logp, adv, mask, agg="seq-mean-token-mean"), logp, 1e-7)


def test_cispo_clipped_stop_gradient_weight():
    from rl.losses import cispo_loss
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, -0.6931472]], requires_grad=True)  # ratios e^0.5 = 1.6487, 0.5
    loss, m = cispo_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), eps_high=0.28)
    # per token: -w * A * logp with w = [1.28 (clipped), 0.5]
    assert loss.item() == pytest.approx((-1.28 * 0.5 + 0.5 * 0.6931472) / 2, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.28 / 2, -0.5 / 2]]), atol=1e-6)  # no token is dropped
    assert m["clipfrac"] == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gspo_token", "cispo", "tgpo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("chunks", [2, 3, 6])
def test_every_loss_is_shard_invariant(name, mode, chunks):
    fn = lookup("loss", name)
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(6, 5, generator=g) * 0.1 - 1
    old = logp + torch.randn(6, 5, generator=g) * 0.05
    adv = torch.randn(6, 1, generator=g).expand(6, 5).clone()
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    full_in = logp.clone().requires_grad_(True)
    full, _ = fn(full_in, old, adv, mask, agg=mode)
    full.backward()
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum())}
    shard_in = logp.clone().requires_grad_(True)
    total = sum(fn(shard_in[i::chunks], old[i::chunks], adv[i::chunks], mask[i::chunks], agg=mode, **counts)[0]
                for i in range(chunks))
    total.backward()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(shard_in.grad, full_in.grad, atol=1e-7)


# ---------------------------------------------------------------------- TGPO (rl/methods/tgpo/README.md, a reconstruction)
def test_tgpo_anchor_gate_and_trust_hand_values():
    from rl.methods.tgpo.loss import tgpo_loss
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.1, -0.1, 0.3]], requires_grad=True)  # log s = 0.1, delta = [0, -0.2, 0.2]
    loss, m = tgpo_loss(logp, old, -torch.ones(1, 3), torch.ones(1, 3), tau=0.1, w_min=0.1)
    gamma = torch.tensor([1.0, math.exp(-4), math.exp(-4)])
    assert m["gate_mean"] == pytest.approx(0.345544, abs=1e-6)
    assert m["trust_mean"] == pytest.approx(0.345544, abs=1e-6)  # negative sample: w = max(w_min, mean gamma)
    # A = -1: the unclipped branch wins, per token w * gamma * s
    expected = 0.345544 * float((gamma * 1.105171).mean())
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert loss.item() == pytest.approx(0.131958, abs=1e-5)


def test_tgpo_band_gate_and_positive_trust():
    from rl.methods.tgpo.loss import tgpo_gate, tgpo_loss
    d = torch.tensor([0.0, 0.2, -0.5])
    # sigmoid((kappa - |delta|)/tau) over its value at delta = 0, sigmoid(2) = 0.880797
    assert torch.allclose(tgpo_gate(d, "band", 0.1, 0.2), torch.sigmoid(torch.tensor([2.0, 0.0, -3.0])) / 0.880797,
                          atol=1e-6)
    assert tgpo_gate(d, "band", 0.1, 0.2)[0] == 1.0
    _, m = tgpo_loss(torch.tensor([[0.1, -0.1, 0.3]]), torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    assert m["trust_mean"] == 1.0  # positive advantage: full trust


def test_tgpo_reduces_to_gspo_token_when_gates_and_trust_are_one():
    from rl.losses import gspo_token_loss
    from rl.methods.tgpo.loss import tgpo_loss
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 5, generator=g) * 0.1 - 1
    base = old + torch.randn(4, 5, generator=g) * 0.05
    adv = torch.tensor([[1.0], [-0.5], [0.3], [-1.2]]).expand(4, 5).clone()
    mask = torch.ones(4, 5)
    _assert_same_loss_and_grad(
        lambda x: tgpo_loss(x, old, adv, mask, tau=1e9, w_min=1.0, eps_low=0.2, eps_high=0.28),
        lambda x: gspo_token_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.28), base, 1e-6)


def test_tgpo_token_anchor_equals_ppo_clip():
    from rl.methods.tgpo.loss import tgpo_loss
    g = torch.Generator().manual_seed(4)
    old = torch.randn(3, 4, generator=g) * 0.1 - 1
    base = old + torch.randn(3, 4, generator=g) * 0.3
    adv = torch.tensor([[1.0], [-1.0], [0.5]]).expand(3, 4).clone()
    mask = torch.ones(3, 4)
    _assert_same_loss_and_grad(
        lambda x: tgpo_loss(x, old, adv, mask, anchor="token", eps_low=0.2, eps_high=0.2, agg="token-mean"),
        lambda x: ppo_clip_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.2, agg="token-mean"), base, 1e-6)


def test_tgpo_on_policy_first_step_equals_grpo_and_reinforce_gradient():
    from rl.losses import gspo_loss
    from rl.methods.tgpo.loss import tgpo_loss
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]])
    adv = torch.tensor([[0.8] * 3, [-0.8] * 3])
    mask = torch.ones(2, 3)
    m, grad = _assert_same_loss_and_grad(lambda x: tgpo_loss(x, logp, adv, mask),
                                         lambda x: gspo_loss(x, logp, adv, mask), logp, 1e-7)
    assert m["gate_mean"] == 1.0 and m["trust_mean"] == 1.0
    # REINFORCE: d loss / d logp_it = -A_i / |y_i| / G
    assert torch.allclose(grad, -adv / 3 / 2, atol=1e-7)


@pytest.mark.parametrize("gate", ["gauss", "band"])
@pytest.mark.parametrize("anchor", ["geo_mean", "token"])
def test_tgpo_on_policy_equals_grpo_with_either_gate_and_anchor(gate, anchor):
    """rl/methods/tgpo/README.md, check 1 for every gate/anchor pair: on policy TGPO is the clipped surrogate without any gate
    (before: the band gate weighted every token by sigmoid(kappa/tau) = 0.88)."""
    from rl.methods.tgpo.loss import tgpo_loss
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]])
    adv = torch.tensor([[0.8] * 3, [-0.8] * 3])
    mask = torch.ones(2, 3)
    other = ppo_clip_loss if anchor == "token" else lookup("loss", "gspo")
    m, _ = _assert_same_loss_and_grad(lambda x: tgpo_loss(x, logp, adv, mask, gate=gate, anchor=anchor),
                                      lambda x: other(x, logp, adv, mask, agg="seq-mean-token-mean"), logp, 1e-7)
    assert m["gate_mean"] == 1.0


def test_tgpo_retains_drifting_negative_trajectories_with_w_min():
    from rl.methods.tgpo.loss import tgpo_loss
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.0, 2.0, -2.0, 0.0]], requires_grad=True)  # large drift: two tokens gated out
    loss, m = tgpo_loss(logp, old, -torch.ones(1, 4), torch.ones(1, 4), w_min=0.1, tau=0.1)
    assert m["trust_mean"] == pytest.approx(0.5)  # mean gate (1 + 0 + 0 + 1)/4, above w_min
    loss.backward()
    assert logp.grad.abs().sum() > 0 and torch.isfinite(logp.grad).all()
    # the gated-out tokens get none, the two on the anchor get w * gamma * r / |y| = 0.5 * 1 * 1 / 4
    assert logp.grad[0].tolist() == pytest.approx([0.125, 0.0, 0.0, 0.125], abs=1e-6)
    logp2 = torch.tensor([[3.0, 2.0, -2.0, -3.0]], requires_grad=True)  # every token drifts
    loss2, m2 = tgpo_loss(logp2, old, -torch.ones(1, 4), torch.ones(1, 4), w_min=0.1, tau=0.1)
    assert m2["trust_mean"] == pytest.approx(0.1)  # floored at w_min, not discarded
    loss2.backward()
    # the documented limitation of the spec's formula: every gate underflows, so the gradient is 0 despite w_min
    assert logp2.grad.abs().max() < 1e-30
    logp3 = logp2.detach().clone().requires_grad_(True)
    loss3, m3 = tgpo_loss(logp3, old, -torch.ones(1, 4), torch.ones(1, 4), w_min=0.1, tau=0.1, gate_floor=0.01)
    loss3.backward()
    # gate_floor keeps it: w_min * floor * r / |y| = 0.1 * 0.01 * exp(0) / 4 per token
    assert logp3.grad[0].tolist() == pytest.approx([0.00025] * 4, rel=1e-5)
    assert m3["trust_mean"] == pytest.approx(0.1)


def test_tgpo_entropy_gate_and_errors():
    from rl.methods.tgpo.loss import tgpo_loss
    z = torch.zeros(1, 2)
    _, m = tgpo_loss(z, z, torch.ones(1, 2), torch.ones(1, 2), h_min=0.5, entropy=torch.tensor([[0.1, 0.9]]))
    assert m["gate_mean"] == 0.5
    with pytest.raises(ValueError, match="entropy"):
        tgpo_loss(z, z, torch.ones(1, 2), torch.ones(1, 2), h_min=0.5)
    with pytest.raises(ValueError, match="step_verified_frac"):
        tgpo_loss(z, z, torch.ones(1, 2), torch.ones(1, 2), trust="step_frac")
    _, m = tgpo_loss(z, z, -torch.ones(1, 2), torch.ones(1, 2), trust="step_frac",
                     step_verified_frac=torch.tensor([0.25]))
    assert m["trust_mean"] == 0.25


def test_tgpo_step_trust_comes_from_the_batch_step_rewards():
    """`trust: step_frac` reads the share of each sample's steps with a positive reward, which the trainer derives
    from the step rewards an environment or a process reward recorded and hands to the loss by name."""
    from models.tiny import build_tiny_tokenizer
    from rl.methods.tgpo.loss import tgpo_loss
    from rl.sft_data import make_sft_batch
    from rl.step import step_verified_fraction
    frac = step_verified_fraction([[1.0, 0.0, -1.0, 1.0], [], [0.5]])
    assert frac.tolist() == [0.5, 0.0, 1.0]
    batch = make_sft_batch(build_tiny_tokenizer(), ["q"] * 3, ["ab", "cd", "ef"])
    batch.set_extra("step_verified_frac", frac)
    fields = batch.named_fields(tgpo_loss)
    assert torch.equal(fields["step_verified_frac"], frac)
    z = torch.zeros(3, 2)
    _, m = tgpo_loss(z, z, -torch.ones(3, 2), torch.ones(3, 2), trust="step_frac", w_min=0.1, **fields)
    assert m["trust_mean"] == pytest.approx((0.5 + 0.1 + 1.0) / 3)


def test_soft_overlong_penalty_ramp():
    from rl.losses import soft_overlong_penalty
    lengths = torch.tensor([10, 16, 18, 20, 25])
    # max 20, buffer 4: no penalty up to 16, then linear to -factor at 20
    assert torch.allclose(soft_overlong_penalty(lengths, 20, 4, 1.0), torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert torch.allclose(soft_overlong_penalty(lengths, 20, 4, 0.5), torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]))


def test_entropy_is_a_metric_unless_the_bonus_needs_its_gradient():
    from models.families import response_logprobs
    from models.tiny import build_tiny_model, build_tiny_tokenizer
    from rl.batch import Batch
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    b = Batch(prompt_ids=torch.tensor([[7, 8]]), prompt_mask=torch.ones(1, 2, dtype=torch.long),
              response_ids=torch.tensor([[9, 10]]), response_mask=torch.ones(1, 2), group_id=torch.zeros(1))
    _, ent = response_logprobs(model, b, with_entropy=True)
    assert not ent.requires_grad and (ent > 0).all()
    _, ent_g = response_logprobs(model, b, with_entropy=True, entropy_grad=True)
    assert ent_g.requires_grad and torch.allclose(ent, ent_g)


# --------------------------------------------------------------------------- rollout IS correction
def _is_case():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: ignored everywhere
    return old, rollout, mask


def test_token_level_truncated_and_masked_weights_hand_values():
    from rl.losses import rollout_importance_weights
    old, rollout, mask = _is_case()
    # log ratios 0.5 and -1.0: weights e^0.5 = 1.6487 and e^-1 = 0.3679
    w, m = rollout_importance_weights(old, rollout, mask, level="token", mode="truncate", cap=10.0)
    assert torch.allclose(w, torch.tensor([[math.exp(0.5), math.exp(-1.0), 0.0]]))
    w, m = rollout_importance_weights(old, rollout, mask, level="token", mode="truncate", cap=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, math.exp(-1.0), 0.0]]))
    assert m["is_capped_frac"] == pytest.approx(0.5)
    assert m["is_weight_mean"] == pytest.approx((1.5 + math.exp(-1.0)) / 2)
    w, _ = rollout_importance_weights(old, rollout, mask, level="token", mode="mask", cap=1.5)
    assert torch.allclose(w, torch.tensor([[0.0, math.exp(-1.0), 0.0]]))


def test_sequence_level_weights_and_mismatch_metrics_hand_values():
    from rl.losses import rollout_importance_weights
    old, rollout, mask = _is_case()
    # sequence log ratio 0.5 - 1.0 = -0.5 -> e^-0.5 = 0.6065 on every response token
    w, m = rollout_importance_weights(old, rollout, mask, level="sequence", cap=2.0)
    assert torch.allclose(w, torch.tensor([[math.exp(-0.5), math.exp(-0.5), 0.0]]))
    assert rollout_importance_weights(old, rollout, mask, level="sequence", cap=0.5)[0][0, :2].tolist() == [0.5, 0.5]
    assert rollout_importance_weights(old, rollout, mask, level="sequence", mode="mask", cap=0.5)[0].abs().sum() == 0
    # k3 of KL(rollout || old) per token: exp(d) - d - 1 with d = old - rollout
    k3 = [math.exp(d) - d - 1 for d in (0.5, -1.0)]
    assert m["mismatch_kl"] == pytest.approx(sum(k3) / 2)
    assert m["mismatch_abs_diff"] == pytest.approx(0.75)
    none_w, none_m = rollout_importance_weights(old, rollout, mask, level="none")
    assert none_w is None and none_m["mismatch_kl"] == pytest.approx(m["mismatch_kl"])
    with pytest.raises(ValueError, match="level"):
        rollout_importance_weights(old, rollout, mask, level="tokens")
    with pytest.raises(ValueError, match="mode"):
        rollout_importance_weights(old, rollout, mask, mode="clip")


def test_weighting_advantages_equals_weighting_the_ppo_term():
    """The learner applies the correction by scaling advantages; for PPO-clip (also with dual-clip)
    that is the same as scaling each token's clipped policy-gradient term, as verl and TRL do."""
    from rl.losses import rollout_importance_weights
    torch.manual_seed(0)
    logp = torch.randn(4, 6) * 0.3 - 1.0
    old = logp + torch.randn(4, 6) * 0.2
    rollout = old + torch.randn(4, 6) * 0.4
    adv = torch.randn(4, 1).expand(4, 6).clone()
    mask = (torch.rand(4, 6) > 0.2).float()
    w, _ = rollout_importance_weights(old, rollout, mask, level="token", cap=1.3)
    weighted, _ = ppo_clip_loss(logp, old, adv * w, mask, dual_clip=3.0)
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
    assert torch.allclose(weighted, (pg * w * mask).sum() / mask.sum(), atol=1e-6)


def test_value_clip_loss_by_hand():
    from rl.losses import value_clip_loss
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 0.0, 0.5]])
    returns = torch.tensor([[0.0, 1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    # token 0: unclipped (1-0)^2 = 1; clipped V = 0.5+0.2 = 0.7 -> 0.49; max 1
    # token 1: (0-1)^2 = 1 both; token 2: unclipped (2-3)^2 = 1, clipped V = 0.7 -> (0.7-3)^2 = 5.29 (clipped wins)
    loss, m = value_clip_loss(values, old, returns, mask, clip=0.2, num_tokens=3.0)
    assert float(loss) == pytest.approx(0.5 * (1 + 1 + 5.29) / 3, abs=1e-6)
    assert m["value_clip_frac"] == pytest.approx(1 / 3)
    unclipped, _ = value_clip_loss(values, old, returns, mask, clip=0.0, num_tokens=3.0)
    assert float(unclipped) == pytest.approx(0.5 * 3 / 3)


# ------------------------------------------------------------------------ edges the hand-computed tests above miss
def test_the_defaults_are_the_documented_ones():
    """token-mean aggregation, k3 in the loss and k1 in the reward, DAPO's overlong factor 1, an IS cap of 2."""
    from rl.losses import kl_in_reward, rollout_importance_weights, soft_overlong_penalty
    v, m = torch.tensor([[1.0, 2.0, 4.0], [8.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(v, m)) == pytest.approx(15 / 4)  # token-mean
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert torch.equal(kl_penalty(logp, ref), kl_penalty(logp, ref, "k3"))
    _, seq_kl = kl_in_reward(torch.zeros(1), logp, ref, torch.ones(1, 2), coef=1.0)
    assert float(seq_kl[0]) == pytest.approx((-1.0 + 1.5) + (-2.0 + 1.0))  # k1: logp - ref, summed
    assert soft_overlong_penalty(torch.tensor([10]), max_len=10, buffer=4).tolist() == [-1.0]
    w, _ = rollout_importance_weights(torch.tensor([[0.0]]), torch.tensor([[-3.0]]), torch.ones(1, 1))
    assert w.tolist() == [[2.0]]  # e^3 capped at 2


def test_unknown_names_and_bad_caps_are_refused_by_name():
    from rl.losses import rollout_importance_weights
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'; choose one of"):
        aggregate_loss(x, torch.ones(1, 2), "sum")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; choose one of"):
        kl_penalty(x, x, "k4")
    for cap in (0.0, -1.0):
        with pytest.raises(ValueError, match="importance-sampling cap must be > 0"):
            rollout_importance_weights(x, x, torch.ones(1, 2), cap=cap)


def test_one_token_one_sequence_and_a_one_token_buffer_are_not_divided_by_more():
    from rl.losses import masked_mean, sequence_log_ratio, soft_overlong_penalty
    assert float(masked_mean(torch.tensor([[3.0, 9.0]]), torch.tensor([[1.0, 0.0]]))) == 3.0
    v, m = torch.tensor([[2.0, 6.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert float(aggregate_loss(v, m, "seq-mean-token-sum-norm", num_seqs=1.0)) == pytest.approx(8 / 3)
    assert float(aggregate_loss(v, m, "seq-mean-token-sum-norm", norm_len=4.0)) == pytest.approx(8 / 4)
    # GSPO's sequence log-ratio of a one-token response is that token's log-ratio
    s = sequence_log_ratio(torch.tensor([[-1.0, -5.0], [-1.0, -2.0]]), torch.tensor([[-1.5, 0.0], [-2.0, -2.5]]),
                           torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert s.flatten().tolist() == pytest.approx([0.5, 0.75])
    assert soft_overlong_penalty(torch.tensor([8, 9, 10]), max_len=10, buffer=1).tolist() == [0.0, 0.0, -1.0]


def test_sequence_level_weights_are_per_sequence_and_a_weight_at_the_cap_is_kept():
    from rl.losses import rollout_importance_weights
    old = torch.tensor([[0.2, 0.1], [-0.4, 0.0]])
    roll = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w, metrics = rollout_importance_weights(old, roll, mask, level="sequence", cap=10.0)
    # one weight per sequence, the product over its own tokens only
    assert w.flatten().tolist() == pytest.approx([math.exp(0.3)] * 2 + [math.exp(-0.4), 0.0])
    # a ratio exactly at the cap is kept in mask mode (verl's ratio <= threshold), only those above are dropped
    at = torch.log(torch.tensor(2.0))
    w, metrics = rollout_importance_weights(torch.stack([at, at + 0.1])[None], torch.zeros(1, 2), torch.ones(1, 2),
                                            mode="mask", cap=2.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 0.0]) and metrics["is_capped_frac"] == 0.5


def test_the_clip_indicator_marks_only_tokens_the_clip_changed():
    from rl.losses import clipped_surrogate
    ratio = torch.tensor([0.9, 1.0, 1.1, 1.5, 0.5])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])
    loss, clipped = clipped_surrogate(ratio, adv, 0.2, 0.2)
    # inside [0.8, 1.2] the clipped and unclipped terms are equal: not clipped; 1.5 with A > 0 and 0.5 with A < 0 are
    assert clipped.tolist() == [False, False, False, True, True]
    assert loss.tolist() == pytest.approx([-0.9, 1.0, -1.1, -1.2, 0.8])


def test_the_loss_and_its_pg_metric_use_the_asked_estimator_aggregation_and_global_counts():
    """regularise_and_aggregate by hand: the KL term with the estimator asked for, the aggregation asked for with
    the global counts given, and `pg_loss` the same aggregation of the policy term alone."""
    from rl.losses import regularise_and_aggregate
    pg = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    logp, ref = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]]), torch.tensor([[-2.0, -1.0, 0.0], [-1.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ent = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    kw = dict(ref_logp=ref, entropy=ent, kl_coef=0.5, entropy_coef=0.1, num_tokens=6.0, num_seqs=4.0, norm_len=5.0)
    k1 = logp - ref
    for agg, reduce in (("token-mean", lambda t: float((t * mask).sum()) / 6.0),
                        ("seq-mean-token-mean", lambda t: float(((t * mask).sum(-1) / mask.sum(-1)).sum()) / 4.0),
                        ("seq-mean-token-sum-norm", lambda t: float((t * mask).sum()) / (4.0 * 5.0))):
        loss, metrics = regularise_and_aggregate(pg, logp, mask, kl_estimator="k1", agg=agg, **kw)
        assert float(loss) == pytest.approx(reduce(pg + 0.5 * k1 - 0.1 * ent)), agg
        assert metrics["pg_loss"] == pytest.approx(reduce(pg)), agg
        assert metrics["kl"] == pytest.approx(float((k1 * mask).sum() / mask.sum()))
    with pytest.raises(ValueError, match="^kl_coef > 0 in the loss needs reference logprobs"):
        regularise_and_aggregate(pg, logp, mask, kl_estimator="k1", agg="token-mean", **{**kw, "ref_logp": None})
    with pytest.raises(ValueError, match="^entropy_coef > 0 needs per-token entropy"):
        regularise_and_aggregate(pg, logp, mask, kl_estimator="k1", agg="token-mean", **{**kw, "entropy": None})
