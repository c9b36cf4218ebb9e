"""RLTT (rl/methods/rltt/README.md): exit pdf, loop weights, the loss table, KL, aggregation and structural checks."""

import pytest
import torch

from models.ouro import exit_pdf
from rl.advantages import compute_grpo_advantages
from rl.losses import kl_penalty
from rl.methods.rltt.loss import compute_loop_weights, rltt_loss
from rl.registry import lookup

LOOP_LOGP = [[-2.0, -1.0, -0.5, -0.25], [-1.0, -1.0, -1.0, -1.0]]
A = 0.866024


def test_grpo_advantages_of_the_spec():
    adv = compute_grpo_advantages(torch.tensor([1.0, 0, 0, 1]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1))
    assert adv[:, 0].tolist() == pytest.approx([0.86602, -0.86602, -0.86602, 0.86602], abs=1e-5)
    same = compute_grpo_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4, 1))
    assert same.abs().max() == 0


def test_exit_pdf_values_and_last_gate_ignored():
    assert exit_pdf(torch.zeros(4)).tolist() == pytest.approx([0.5, 0.25, 0.125, 0.125])
    p = exit_pdf(torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    assert p.tolist() == pytest.approx([0.268941, 0.365529, 0.267223, 0.098306], abs=1e-6)
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-7)
    assert torch.equal(exit_pdf(torch.tensor([-1.0, 0.0, 1.0, -7.0])), p)
    assert exit_pdf(torch.tensor([3.0])).tolist() == [1.0]  # one loop: all mass on it


def test_loop_weights():
    assert compute_loop_weights("progressive", 4, alpha=1.0).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert compute_loop_weights("progressive", 4, alpha=2.0).tolist() == pytest.approx([1 / 30, 4 / 30, 9 / 30, 16 / 30])
    assert torch.allclose(compute_loop_weights("progressive", 4, alpha=0.0), compute_loop_weights("uniform", 4))
    assert compute_loop_weights("last", 4).tolist() == [0, 0, 0, 1]
    assert compute_loop_weights("learned", 4, learned_logits=torch.zeros(4)).tolist() == [0.25] * 4
    init = torch.log(compute_loop_weights("progressive", 4))  # the other documented init
    assert compute_loop_weights("learned", 4, learned_logits=init).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match="loop_weighting"):
        compute_loop_weights("cubic", 4)


def _one_sequence(weighting, **kw):
    loop_logp = torch.tensor([LOOP_LOGP], requires_grad=True)  # [1, 2 tokens, 4 loops]
    adv = torch.full((1, 2), A)
    mask = torch.ones(1, 2)
    loss, metrics = rltt_loss(loop_logp[..., -1], loop_logp[..., -1].detach(), adv, mask, loop_logp=loop_logp,
                              loop_weighting=weighting, kl_coef=0.0, **kw)
    loss.backward()
    return float(loss.detach()), loop_logp.grad[0, 0].tolist()


@pytest.mark.parametrize("weighting,kw,expected,grad", [
    ("uniform", {}, 0.838961, [-0.108253] * 4),
    ("progressive", {"alpha": 1.0}, 0.714470, [-0.043301, -0.086602, -0.129904, -0.173205]),
    ("progressive", {"alpha": 2.0}, 0.642301, None),
    ("exit_pdf", {"exit_pdf": exit_pdf(torch.zeros(1, 2, 4))}, 1.014872, [-0.216506, -0.108253, -0.054126, -0.054126]),
    ("last", {}, 0.541265, [0.0, 0.0, 0.0, -0.433012]),
])
def test_loss_table_of_the_spec(weighting, kw, expected, grad):
    loss, g = _one_sequence(weighting, **kw)
    assert loss == pytest.approx(expected, abs=1e-6)
    if grad is not None:
        assert g == pytest.approx(grad, abs=1e-6)


def test_kl_on_the_final_loop_only():
    assert float(kl_penalty(torch.tensor(-1.2), torch.tensor(-1.0), "k3")) == pytest.approx(0.0214028, abs=1e-7)
    assert float(kl_penalty(torch.tensor(-1.0), torch.tensor(-1.0), "k3")) == 0.0
    # final loop logp -1.2, earlier loops anything; ref -1.0; zero advantage leaves only β·KL
    loop_logp = torch.tensor([[[-5.0, -3.0, -0.1, -1.2]]])
    loss, metrics = rltt_loss(loop_logp[..., -1], loop_logp[..., -1], torch.zeros(1, 1), torch.ones(1, 1),
                              loop_logp=loop_logp, ref_logp=torch.tensor([[-1.0]]), loop_weighting="uniform",
                              kl_coef=0.001)
    assert float(loss) == pytest.approx(0.001 * 0.0214028, abs=1e-10)
    assert metrics["kl"] == pytest.approx(0.0214028, abs=1e-7)


def test_aggregation_convention():
    # sequence A: one token, logP −1, Â +1; sequence B: three tokens, logP −1 each, Â −1
    loop_logp = torch.full((2, 3, 1), -1.0)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
    token_mean, _ = rltt_loss(loop_logp[..., -1], loop_logp[..., -1], adv, mask, loop_logp=loop_logp,
                              loop_weighting="uniform", kl_coef=0.0, agg="token-mean")
    seq_mean, _ = rltt_loss(loop_logp[..., -1], loop_logp[..., -1], adv, mask, loop_logp=loop_logp,
                            loop_weighting="uniform", kl_coef=0.0, agg="seq-mean-token-mean")
    assert float(token_mean) == pytest.approx(-0.5)
    assert float(seq_mean) == pytest.approx(0.0)


def test_one_loop_rltt_is_reinforce_grpo():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g)).requires_grad_()
    adv, mask = torch.randn(3, 1, generator=g).expand(3, 5), (torch.rand(3, 5, generator=g) > 0.3).float()
    for weighting in ("uniform", "progressive", "exit_pdf", "last"):
        loss, _ = rltt_loss(logp, logp.detach(), adv, mask, loop_logp=logp[..., None], loop_weighting=weighting,
                            exit_pdf=exit_pdf(torch.randn(3, 5, 1, generator=g)), kl_coef=0.0)
        reinforce = -(adv * logp * mask).sum() / mask.sum()
        assert torch.allclose(loss, reinforce)


def test_gradients_by_loop_and_into_the_gate():
    torch.manual_seed(0)
    hidden = [torch.randn(2, 3, 8, requires_grad=True) for _ in range(4)]  # per-loop states
    head, gate = torch.nn.Linear(8, 11, bias=False), torch.nn.Linear(8, 1)
    labels = torch.randint(0, 11, (2, 3))

    def loss_with(weighting, detach=False):
        for p in [*hidden, *head.parameters(), *gate.parameters()]:
            p.grad = None
        loop_logp = torch.stack([torch.log_softmax(head(h), -1).gather(-1, labels[..., None]).squeeze(-1)
                                 for h in hidden], -1)
        pdf = exit_pdf(torch.cat([gate(h) for h in hidden], -1))
        loss, _ = rltt_loss(loop_logp[..., -1], loop_logp[..., -1], torch.tensor([[1.0], [-0.5]]).expand(2, 3),
                            torch.ones(2, 3), loop_logp=loop_logp, exit_pdf=pdf, loop_weighting=weighting,
                            detach_exit_pdf=detach, kl_coef=0.0)
        loss.backward()

    loss_with("last")  # GRPO credit: earlier loops get exactly zero gradient
    assert all(float(h.grad.abs().sum()) == 0.0 for h in hidden[:3]) and hidden[3].grad.abs().sum() > 0
    per_state = []  # uniform: lm_head's gradient has a contribution from every loop's state
    hooks = [h.register_hook(lambda g: per_state.append(float(g.abs().sum()))) for h in hidden]
    loss_with("uniform")
    assert len(per_state) == 4 and all(v > 0 for v in per_state)
    for hk in hooks:
        hk.remove()
    loss_with("exit_pdf")
    assert gate.weight.grad.abs().sum() > 0
    loss_with("exit_pdf", detach=True)
    assert gate.weight.grad is None or float(gate.weight.grad.abs().sum()) == 0.0


def test_registered_and_declares_its_learned_loop_logits():
    assert lookup("loss", "rltt") is rltt_loss
    outputs = {"loop_logp": torch.zeros(2, 3, 4)}
    assert rltt_loss.trainable_parameters(outputs, loop_weighting="exit_pdf") == {}
    declared = rltt_loss.trainable_parameters(outputs, loop_weighting="learned", learned_init="progressive",
                                              learned_lr_scale=5.0)
    p = declared["learned_logits"]
    assert p.lr_scale == 5.0 and p.init.shape == (4,) and float(p.init.sum()) == pytest.approx(0.0, abs=1e-6)
    assert torch.softmax(p.init, -1).tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match="learned_init"):
        rltt_loss.trainable_parameters(outputs, loop_weighting="learned", learned_init="ramp")


@pytest.mark.parametrize("weighting", ["uniform", "exit_pdf", "last"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_rltt_is_shard_invariant(weighting, mode, chunks):
    g = torch.Generator().manual_seed(4)
    loop_logp = torch.randn(6, 5, 4, generator=g) * 0.1 - 1
    gates = torch.randn(6, 5, 4, generator=g)
    ref = loop_logp[..., -1] + torch.randn(6, 5, generator=g) * 0.05
    adv = torch.randn(6, 1, generator=g).expand(6, 5).clone()
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1

    def loss(x, gate, rows, **counts):
        return rltt_loss(x[rows][..., -1], None, adv[rows], mask[rows], loop_logp=x[rows], ref_logp=ref[rows],
                         exit_pdf=exit_pdf(gate[rows]), loop_weighting=weighting, kl_coef=0.01, agg=mode, **counts)[0]

    full_x, full_g = loop_logp.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    full = loss(full_x, full_g, slice(None))
    full.backward()
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum())}
    x, gate = loop_logp.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    total = sum(loss(x, gate, slice(i, None, chunks), **counts) for i in range(chunks))
    total.backward()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(x.grad, full_x.grad, atol=1e-7)
    if weighting == "exit_pdf":  # the gate gets gradient only through the exit-pdf weights
        assert torch.allclose(gate.grad, full_g.grad, atol=1e-7)
    else:
        assert gate.grad is None


@pytest.mark.parametrize("kl_coef,kl_in_reward,expected", [(0.0, False, 0.0), (0.001, True, 0.0), (0.02, False, 0.02)])
def test_recipe_kl_is_the_single_source_of_the_loss_kl(kl_coef, kl_in_reward, expected):
    """`algorithm.kl_coef` / `kl_in_reward` decide the loss's KL term: no KL (and no reference) runs RLTT without
    a KL term instead of failing on missing reference logprobs, KL in the reward adds none in the loss."""
    from rl import config
    from rl.recipe import policy_loss_params
    cfg = config.load("recipes/rltt_tiny.yaml", [f"algorithm.kl_coef={kl_coef}", f"algorithm.kl_in_reward={kl_in_reward}"])
    params = policy_loss_params(cfg, rltt_loss)
    assert params["kl_coef"] == expected
    g = torch.Generator().manual_seed(0)
    loop_logp = -torch.rand(2, 3, 4, generator=g)
    ref = None if kl_coef == 0 else loop_logp[..., -1] - 0.3
    adv, mask = torch.tensor([[1.0], [-1.0]]).expand(2, 3), torch.ones(2, 3)
    pdf = exit_pdf(torch.randn(2, 3, 4, generator=g))
    loss, _ = rltt_loss(loop_logp[..., -1], None, adv, mask, loop_logp=loop_logp, exit_pdf=pdf, ref_logp=ref,
                        **params)
    without_kl, _ = rltt_loss(loop_logp[..., -1], None, adv, mask, loop_logp=loop_logp, exit_pdf=pdf, ref_logp=ref,
                              **{**params, "kl_coef": 0.0})
    kl = 0.0 if ref is None else float(kl_penalty(loop_logp[..., -1], ref, "k3").mean())
    assert float(loss) == pytest.approx(float(without_kl) + expected * kl, abs=1e-6)


def test_a_loss_without_a_kl_term_refuses_a_kl_coef_in_the_loss():
    from rl import config
    from rl.config import ConfigError
    from rl.recipe import policy_loss_params

    def plain_loss(logp, old_logp, advantages, response_mask, *, agg="token-mean", norm_len=None):
        return (-(advantages * logp) * response_mask).sum(), {}

    cfg = config.load("recipes/rltt_tiny.yaml", ["algorithm.kl_coef=0.01"])
    with pytest.raises(ConfigError, match="algorithm.kl_coef"):
        policy_loss_params(cfg, plain_loss)
    cfg = config.load("recipes/rltt_tiny.yaml", ["algorithm.kl_coef=0.01", "algorithm.kl_in_reward=true"])
    assert "kl_coef" not in policy_loss_params(cfg, plain_loss)
