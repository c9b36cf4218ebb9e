"""Optimizers and schedulers named in the recipe: hand-computed values for MeZO and the schedules."""

import math

import pytest
import torch

from rl.optim import MeZO, adamw, constant, cosine, is_forward_only
from rl.registry import lookup


def _quadratic(theta):
    return 0.5 * (theta * theta).sum()


def test_mezo_step_is_the_spsa_estimate_along_the_seeded_direction():
    # L = ||θ||²/2: L(θ+εu) − L(θ−εu) = 2ε θ·u exactly, so the projected gradient is θ·u and the step is
    # θ' = θ − lr (θ·u) u, with u the first draw of a CPU generator seeded 7 * 1_000_003 + 0.
    theta = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = MeZO([theta], lr=0.1, eps=1e-3, seed=7)
    start = theta.detach().clone()
    u = torch.randn(3, generator=torch.Generator().manual_seed(7 * 1_000_003))
    loss = opt.step(lambda: _quadratic(theta))
    g = float(start @ u)
    assert opt.last["projected_grad"] == pytest.approx(g, rel=1e-3)
    assert torch.allclose(theta.detach(), start - 0.1 * g * u, atol=1e-5)
    assert float(loss) == pytest.approx(float(_quadratic(start)) + 0.5 * 1e-6 * float(u @ u), rel=1e-4)
    assert theta.grad is None  # no backward ran
    # the next step uses the next seed (a new direction)
    before = theta.detach().clone()
    opt.step(lambda: _quadratic(theta))
    u2 = torch.randn(3, generator=torch.Generator().manual_seed(7 * 1_000_003 + 1))
    step = (theta.detach() - before) / u2
    assert torch.allclose(step, step[0].expand(3), atol=1e-5)  # the update is along u2


def test_mezo_perturbations_restore_the_weights():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32, generator=g)), torch.nn.Parameter(torch.randn(32, generator=g))]
    start = [p.detach().clone() for p in params]
    opt = MeZO(params, lr=0.0, eps=1e-3)
    for scale in (1.0, -2.0, 1.0):
        opt.perturb(123, scale)
    # +εu, −2εu, +εu returns each weight to within rounding (spec: 1e-7 in fp32; here 1e-7 absolute near
    # zero and two fp32 ulps for the weights of magnitude 1-4)
    assert all(torch.allclose(p.detach(), s, rtol=2.5e-7, atol=1e-7) for p, s in zip(params, start))


def test_mezo_lowers_a_loss_without_gradients_and_resumes_exactly():
    torch.manual_seed(0)
    target = torch.randn(20)
    theta = torch.nn.Parameter(torch.zeros(20))
    opt = MeZO([theta], lr=0.5, eps=1e-3, seed=1)

    @torch.no_grad()
    def loss():
        return ((theta - target) ** 2).mean()

    first = float(loss())
    for _ in range(200):
        opt.step(loss)
    assert float(loss()) < 0.3 * first and theta.grad is None
    # a restored optimizer (seed and step count in its state) continues with the same directions
    saved, copy = opt.state_dict(), torch.nn.Parameter(theta.detach().clone())
    resumed = MeZO([copy], lr=0.5, eps=1e-3, seed=99)
    resumed.load_state_dict(saved)
    opt.step(loss)
    resumed.step(lambda: ((copy - target) ** 2).mean())
    assert torch.equal(copy, theta)


def test_optimizers_are_registered_and_marked():
    assert lookup("optimizer", "adamw") is adamw and lookup("optimizer", "mezo").forward_only
    p = [torch.nn.Parameter(torch.ones(2))]
    assert not is_forward_only(adamw(p, lr=1e-3)) and is_forward_only(lookup("optimizer", "mezo")(p, lr=1e-3))


def test_adamw_factory_matches_torch_adamw():
    a, b = torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    mine = adamw([a], lr=0.1, weight_decay=0.01, betas=[0.8, 0.9], eps=1e-6)
    ref = torch.optim.AdamW([b], lr=0.1, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-6)
    for _ in range(3):
        for p, o in ((a, mine), (b, ref)):
            o.zero_grad()
            (p ** 3).sum().backward()
            o.step()
    assert torch.allclose(a, b, atol=1e-7)


def _factors(make, steps, **kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = make(opt, **kw)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0] / 2.0)
        opt.step()
        sched.step()
    return out


def test_schedules_hand_values():
    assert _factors(constant, 4, warmup_steps=2, total_steps=4) == pytest.approx([0.5, 1.0, 1.0, 1.0])
    # warm-up 2 of 6 steps, then cosine over 4 steps to 10%: 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2
    expected = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert _factors(cosine, 6, warmup_steps=2, total_steps=6) == pytest.approx(expected)
    assert _factors(cosine, 3, total_steps=2, min_lr_ratio=0.0) == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)
