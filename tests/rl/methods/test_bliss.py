"""BLISS (rl/methods/bliss/README.md): the implicit hypergradient against finite differences on a quadratic lower
level, the softmax Jacobian against autograd, and one outer step split over two ranks equal to one rank (the
`bliss` stage runs end to end in tests/rl/methods/test_data_stages.py)."""

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp

from models.tiny import build_tiny_model, build_tiny_tokenizer
from rl.batch import batch_of_examples
from rl.methods.bliss.core import (
    BilevelSelector,
    Collective,
    ScoreModel,
    global_softmax,
    softmax_coefficients,
    solve_z,
)
from rl.sft_data import prompt_response_example


def test_softmax_coefficients_equal_autograd_through_the_softmax():
    torch.manual_seed(0)
    s = torch.randn(7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(7, dtype=torch.float64)
    phi = -(torch.softmax(s, 0) * g).sum()  # −Σ P_i g_i
    (auto,) = torch.autograd.grad(phi, s)
    closed = softmax_coefficients(torch.softmax(s, 0).detach(), g)
    assert torch.allclose(closed, auto, atol=1e-12)
    # hand-computed: P = (0.5, 0.5), g = (1, 3) -> mean 2, c = (0.5, -0.5)
    assert softmax_coefficients(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 3.0])).tolist() == [0.5, -0.5]


def _quadratic(seed=0, d=5, n=6, m=4):
    """G(θ, w) = ½ θᵀAθ + Σ_i P_i(w) CE_i(θ) with CE_i = −θᵀ b_i, P = softmax(sigmoid(Φ w)); f(θ) = ½‖θ − t‖²."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(d, d, generator=gen, dtype=torch.float64)
    a = q @ q.T + d * torch.eye(d, dtype=torch.float64)
    b = torch.randn(n, d, generator=gen, dtype=torch.float64)
    feats = torch.randn(n, m, generator=gen, dtype=torch.float64)
    t = torch.randn(d, generator=gen, dtype=torch.float64)
    w = torch.randn(m, generator=gen, dtype=torch.float64)

    def scores(w):
        return torch.sigmoid(feats @ w)

    def theta_star(w):
        return torch.linalg.solve(a, (torch.softmax(scores(w), 0)[:, None] * b).sum(0))

    def f(w):
        return 0.5 * ((theta_star(w) - t) ** 2).sum()
    return a, b, w, scores, theta_star, f, t


def _hypergradient(a, b, w, scores, theta_star, t, z):
    w = w.clone().requires_grad_(True)
    s = scores(w)
    p = torch.softmax(s, 0).detach()
    g = -(b @ z)  # <∇CE_i, z> with ∇CE_i = −b_i
    (grad,) = torch.autograd.grad((softmax_coefficients(p, g) * s).sum(), w)
    return grad


def test_implicit_hypergradient_matches_finite_differences_and_the_iterative_solve_converges():
    a, b, w, scores, theta_star, f, t = _quadratic()
    f_y = theta_star(w) - t
    exact = _hypergradient(a, b, w, scores, theta_star, t, torch.linalg.solve(a, f_y))
    eps = 1e-6
    fd = torch.stack([(f(w + eps * e) - f(w - eps * e)) / (2 * eps) for e in torch.eye(len(w), dtype=w.dtype)])
    assert ((exact - fd).norm() / fd.norm()) < 1e-3
    # z_loops gradient steps on the linear system (λ_z = 0, no clipping): the error shrinks with more loops
    lr_z = 1.0 / torch.linalg.eigvalsh(a).max().item()
    errors = [float((_hypergradient(a, b, w, scores, theta_star, t,
                                    solve_z(lambda z: a @ z, f_y, loops, lr_z, 0.0, clip=None)) - fd).norm() / fd.norm())
              for loops in (1, 3, 10, 30, 300)]
    assert all(x > y for x, y in zip(errors, errors[1:])) and errors[-1] < 1e-3, errors
    # λ_z damps the system: the solve then tends to (H + λI)⁻¹ F_y
    damped = solve_z(lambda z: a @ z, f_y, 2000, lr_z, 0.5, clip=None)
    assert torch.allclose(damped, torch.linalg.solve(a + 0.5 * torch.eye(len(a), dtype=a.dtype), f_y), atol=1e-8)


def _setup(seed=0):
    tok = build_tiny_tokenizer()
    proxy = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=seed)
    proxy.config._attn_implementation = "eager"  # double backward (Hessian-vector products)
    target = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed + 1)
    pairs = [("12+3=", "15"), ("7*8=", "56"), ("ab", "ba"), ("9-4=", "5"), ("x", "zzzz"), ("1+1=", "2"),
             ("cd", "dc"), ("5*5=", "25")]
    examples = [prompt_response_example(tok, p, r) for p, r in pairs]
    batch = batch_of_examples(examples, tok.pad_token_id)
    val = batch_of_examples([prompt_response_example(tok, "2+2=", "4"), prompt_response_example(tok, "3*3=", "9")],
                            tok.pad_token_id)
    with torch.no_grad():
        P = batch.prompt_ids.shape[1]
        L = batch.response_ids.shape[1]
        target_logp = torch.log_softmax(target(**batch.model_inputs()).logits[:, P - 1:P - 1 + L], -1)
    torch.manual_seed(seed)
    score = ScoreModel(proxy)
    return proxy, score, batch, val, target_logp


def _rows(batch, idx):
    from rl.batch import Batch
    return Batch(prompt_ids=batch.prompt_ids[idx], prompt_mask=batch.prompt_mask[idx],
                 response_ids=batch.response_ids[idx], response_mask=batch.response_mask[idx],
                 response_attn=batch.response_attn[idx], group_id=batch.group_id[idx])


HYPER = {"lr": 1e-2, "score_lr": 1e-2, "gamma": 0.5, "reg": 1e-4, "inner_steps": 2, "z_loops": 3}


def _one_rank_result():
    proxy, score, batch, val, target_logp = _setup()
    sel = BilevelSelector(proxy, score, **HYPER)
    weights = global_softmax(sel.scores(batch), sel.col)
    metrics = sel.outer_step(batch, val, target_logp)
    return proxy.state_dict(), score.state_dict(), weights, metrics


def _rank_main(rank, port, out_dir):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    proxy, score, batch, val, target_logp = _setup()
    half = slice(rank * 4, rank * 4 + 4)
    mine = _rows(batch, list(range(8))[half])
    sel = BilevelSelector(proxy, score, Collective(), **HYPER)
    weights = sel.col.gather(global_softmax(sel.scores(mine), sel.col))
    metrics = sel.outer_step(mine, _rows(val, [rank]), target_logp[half])
    torch.save({"proxy": proxy.state_dict(), "score": score.state_dict(), "weights": weights, "metrics": metrics},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_an_outer_step_over_two_ranks_equals_one_rank_on_the_whole_batch(tmp_path):
    """The softmax over the global batch, the losses, Hessian-vector products and both updates: two gloo ranks
    with half the batch each end with the weights one process reaches on the whole batch."""
    from cluster.ray_utils import free_port
    ref_proxy, ref_score, ref_weights, ref_metrics = _one_rank_result()
    assert ref_weights.sum().item() == pytest.approx(1.0, abs=1e-6)
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        assert torch.allclose(got["weights"], ref_weights, atol=1e-7) and got["weights"].sum() == pytest.approx(1.0)
        for ref, key in ((ref_proxy, "proxy"), (ref_score, "score")):
            for name, v in ref.items():
                # fp32 sums in another order (two ranks' halves plus an all-reduce) through the Hessian-vector
                # products: up to 3.5e-6 apart on an AVX-512 CPU, where the step moves the weights by up to 1e-2
                assert torch.allclose(got[key][name], v, atol=1e-5, rtol=1e-4), (key, name)
        for key in ("val_ce", "lower_loss", "weight_max", "z_norm", "score_grad_norm"):  # summed over the ranks
            assert got["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4), key
    # the step moved both models (the comparison is not between two untouched copies)
    proxy0, score0, _, _, _ = _setup()
    assert any(not torch.allclose(proxy0.state_dict()[k], v) for k, v in ref_proxy.items())
    assert any(not torch.allclose(copy.deepcopy(score0).state_dict()[k], v) for k, v in ref_score.items())


def _head_only_problem(seed=0):
    """A proxy whose only trainable weights are its output head: the lower level (weighted CE plus the ridge) is
    then strictly convex, so its optimum for any sample weights can be found to precision and the hypergradient
    of the validation loss checked by finite differences of the whole bilevel problem."""
    tok = build_tiny_tokenizer()
    proxy = build_tiny_model(tok, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16, seed=seed)
    # the backbone is frozen, so no double backward runs through its attention: sdpa, which keeps float64 finite
    # on padding rows
    for name, p in proxy.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))
    pairs = [("12+3=", "15"), ("7*8=", "56"), ("ab", "ba"), ("9-4=", "5"), ("x", "zzzz"), ("cd", "dc")]
    batch = batch_of_examples([prompt_response_example(tok, p, r) for p, r in pairs], tok.pad_token_id)
    val = batch_of_examples([prompt_response_example(tok, "2+2=", "4"), prompt_response_example(tok, "dc", "cd")],
                            tok.pad_token_id)
    torch.manual_seed(seed)
    score = ScoreModel(proxy)  # its backbone is frozen with the proxy's: the head (9 numbers) is what it learns
    return proxy.double(), score.double(), batch, val


def _solve_lower_level(sel, batch, weights):
    """The proxy's head at the optimum of G for `weights` (L-BFGS from where it stands)."""
    opt = torch.optim.LBFGS(sel.params, lr=1, max_iter=100, tolerance_grad=-1.0, tolerance_change=-1.0,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss, _ = sel.lower_level_loss(batch, weights, None)
        loss.backward()
        return loss
    for _ in range(3):
        opt.step(closure)
    opt.zero_grad(set_to_none=True)


def _validation_loss_at_the_optimum(sel, batch, val, head_state):
    """Φ(θs): the validation loss of the proxy trained to the lower level's optimum under the weights the score
    model with head `head_state` gives."""
    from rl.methods.bliss.core import sequence_stats
    with torch.no_grad():
        sel.score_model.head.load_state_dict(head_state)
        weights = global_softmax(sel.scores(batch), sel.col)
    _solve_lower_level(sel, batch, weights)
    with torch.no_grad():
        return float(sequence_stats(sel.proxy, val)[0].mean())


def test_the_score_models_update_descends_the_validation_loss_of_the_trained_proxy_by_finite_differences():
    """`outer_step` end to end: at the lower level's optimum, with the z-solve converged, the score model's step
    (plain SGD in place of AdamW, so the step is the hypergradient times the rate) equals −lr × the gradient of
    Φ(θs) = f(θp*(θs)) that central differences of the whole bilevel problem give, in direction and size."""
    proxy, score, batch, val = _head_only_problem()
    sel = BilevelSelector(proxy, score, lr=0.0, gamma=0.0, reg=0.05, grad_clip=0.0, inner_steps=1, z_loops=600,
                          lr_z=0.5, lamb=0.0)
    rate = 0.1
    sel.score_opt = torch.optim.SGD(sel.score_params, lr=rate)
    start = copy.deepcopy(score.head.state_dict())
    _solve_lower_level(sel, batch, global_softmax(sel.scores(batch), sel.col))
    theta_star = [p.detach().clone() for p in sel.params]
    sel.outer_step(batch, val)
    step = torch.cat([(score.head.state_dict()[k] - start[k]).reshape(-1) for k in start])
    assert all(torch.equal(p, q) for p, q in zip(sel.params, theta_star))  # lr 0: the proxy stayed at the optimum

    fd, eps = [], 1e-3
    flat_start = torch.cat([start[k].reshape(-1) for k in start])
    for i in range(len(flat_start)):
        values = []
        for sign in (1, -1):
            moved = flat_start.clone()
            moved[i] += sign * eps
            state = {"weight": moved[:-1].view_as(start["weight"]), "bias": moved[-1:].clone()}
            with torch.no_grad():
                for p, q in zip(sel.params, theta_star):
                    p.copy_(q)
            values.append(_validation_loss_at_the_optimum(sel, batch, val, state))
        fd.append((values[0] - values[1]) / (2 * eps))
    grad = torch.tensor(fd, dtype=torch.float64)
    expected = -rate * grad
    cosine = float(step @ expected / (step.norm() * expected.norm()))
    assert expected.norm() > 1e-4  # the problem has a hypergradient worth checking
    assert cosine > 0.999, (step, expected)
    assert float(step.norm() / expected.norm()) == pytest.approx(1.0, rel=0.02)


def test_both_rates_warm_up_linearly_over_the_first_outer_steps():
    """`warmup_steps` W: the k-th outer step (from 0) runs at min(1, (k + 1) / W) of each rate, so AdamW's first
    proxy update (proportional to the rate) is 1/W of the one without warm-up."""
    moves = {}
    for warmup in (0, 4):
        proxy, score, batch, val, target_logp = _setup()
        before = [p.detach().clone() for p in proxy.parameters()]
        sel = BilevelSelector(proxy, score, **{**HYPER, "inner_steps": 1, "warmup_steps": warmup})
        rates = []
        for _ in range(5):
            rates.append((sel.opt.param_groups[0]["lr"], sel.score_opt.param_groups[0]["lr"]))
            sel.outer_step(batch, val, target_logp)
            if len(rates) == 1:
                moves[warmup] = torch.cat([(p.detach() - q).reshape(-1) for p, q in zip(proxy.parameters(), before)])
        if warmup:
            lr, score_lr = HYPER["lr"], HYPER["score_lr"]
            assert rates == [pytest.approx((lr * f, score_lr * f)) for f in (0.25, 0.5, 0.75, 1.0, 1.0)]
    assert torch.allclose(moves[4], moves[0] / 4, rtol=1e-4, atol=1e-9)


def test_the_selector_and_the_stage_share_the_released_defaults():
    """The README's released settings (AdamW betas 0.9/0.95, weight decay 0.1, rates 1e-5, 5 inner steps, 3
    z-loops, gamma 1e-2, reg 1e-7) are the selector's keyword defaults and the stage's."""
    import inspect

    from rl.methods.bliss.stage import BlissStage
    released = {"lr": 1e-5, "score_lr": 1e-5, "weight_decay": 0.1, "grad_clip": 1.0, "reg": 1e-7, "gamma": 1e-2,
                "inner_steps": 5, "z_loops": 3, "lr_z": 1e-2, "lamb": 1e-2}
    selector = {k: p.default for k, p in inspect.signature(BilevelSelector).parameters.items() if k in released}
    stage = {k: p.default for k, p in inspect.signature(BlissStage).parameters.items() if k in released}
    assert selector == stage == released
    proxy, score, *_ = _setup()
    sel = BilevelSelector(proxy, score)
    for opt in (sel.opt, sel.score_opt):
        assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.1
        assert opt.param_groups[0]["lr"] == 1e-5  # no warm-up: the full rate from the first step
    assert (sel.grad_clip, sel.reg, sel.gamma, sel.inner_steps, sel.z_loops, sel.lr_z, sel.lamb) == (
        1.0, 1e-7, 1e-2, 5, 3, 1e-2, 1e-2)


def test_solve_z_hand_values_with_and_without_the_step_clip():
    """H = diag(2, 1), f = (1, 0), λ 0.5, lr 0.1, from (0.5, 0.5): two steps by hand; a clip of 0.05 rescales the
    first step (norm 0.0791) to norm 0.05."""
    h = torch.tensor([2.0, 1.0], dtype=torch.float64)
    f = torch.tensor([1.0, 0.0], dtype=torch.float64)
    z = solve_z(lambda v: h * v, f, loops=2, lr_z=0.1, lamb=0.5)
    assert torch.allclose(z, torch.tensor([0.45625, 0.36125], dtype=torch.float64))
    clipped = solve_z(lambda v: h * v, f, loops=1, lr_z=0.1, lamb=0.5, clip=0.05)
    step = torch.tensor([0.025, 0.075], dtype=torch.float64)
    assert torch.allclose(clipped, 0.5 - step * 0.05 / step.norm())
    assert torch.allclose(solve_z(lambda v: h * v, f, loops=0, lr_z=0.1, lamb=0.5, init=f), f)


class _FixedLogits(torch.nn.Module):
    """A stand-in forward with given logits: `sequence_stats` is arithmetic on them."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, **inputs):
        from types import SimpleNamespace
        return SimpleNamespace(logits=self.logits)


def test_sequence_stats_hand_values_read_the_response_positions_and_its_mask():
    """Prompt of 2, response of 2 (row 1 trains its first token only), vocabulary 3: per row the token-mean CE of the
    trained tokens, the summed KL(target || model) over them and their count."""
    from rl.batch import Batch
    from rl.methods.bliss.core import sequence_stats
    probs = torch.tensor([[[0.9, 0.05, 0.05], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.05, 0.9, 0.05]],
                          [[0.05, 0.05, 0.9], [0.1, 0.6, 0.3], [0.7, 0.2, 0.1], [0.9, 0.05, 0.05]]])
    target = torch.tensor([[[0.25, 0.25, 0.5], [0.2, 0.3, 0.5]], [[0.3, 0.6, 0.1], [1 / 3, 1 / 3, 1 / 3]]]).log()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    batch = Batch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                  response_ids=torch.tensor([[0, 2], [1, 0]]), response_mask=mask, response_attn=mask.long(),
                  group_id=torch.arange(2))
    ce, kl, tokens = sequence_stats(_FixedLogits(probs.log().to(torch.bfloat16).float()), batch, target)
    ln2, ln3 = torch.log(torch.tensor(2.0)), torch.log(torch.tensor(3.0))
    assert torch.allclose(ce, torch.stack([ln2, -torch.log(torch.tensor(0.6))]), atol=1e-2)
    assert torch.allclose(kl, torch.stack([0.25 * ln2, 0.2 * ln3]), atol=1e-2)
    assert tokens.tolist() == [2.0, 1.0]
    exact, no_kl, _ = sequence_stats(_FixedLogits(probs.log().double()), batch)
    assert exact.dtype == torch.float64 and torch.allclose(exact, torch.stack([ln2, -torch.log(torch.tensor(0.6))])
                                                           .double())
    assert torch.equal(no_kl, torch.zeros(2, dtype=torch.float64))
    from rl.methods.bliss.core import at_least_float32
    assert at_least_float32(torch.ones(1, dtype=torch.bfloat16)).dtype == torch.float32


def test_the_lower_level_loss_is_weighted_ce_plus_kl_per_global_token_plus_the_ridge():
    from rl.methods.bliss.core import sequence_stats
    proxy, score, batch, val, target_logp = _setup()
    sel = BilevelSelector(proxy, score, gamma=0.5, reg=1e-3)
    weights = torch.softmax(torch.arange(8.0), 0)
    loss, ce = sel.lower_level_loss(batch, weights, target_logp)
    ce_ref, kl, tokens = sequence_stats(proxy, batch, target_logp)
    ridge = sum((p.detach() ** 2).sum() for p in proxy.parameters())
    expected = (weights * ce_ref).sum() + 0.5 * kl.sum() / tokens.sum() + 1e-3 * ridge
    assert torch.allclose(ce, ce_ref) and float(loss) == pytest.approx(float(expected), rel=1e-6)
    bare, _ = BilevelSelector(proxy, score, gamma=0.0, reg=0.0).lower_level_loss(batch, weights, target_logp)
    assert float(bare) == pytest.approx(float((weights * ce_ref).sum()), rel=1e-6)


def test_an_optimizer_step_clips_the_summed_gradient_and_clears_it():
    proxy, score, *_ = _setup()
    sel = BilevelSelector(proxy, score, grad_clip=1.0)
    params = sel.score_params
    sel.score_opt = torch.optim.SGD(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    count = sum(p.numel() for p in params)
    norm = sel._step(sel.score_opt, params)
    assert norm == pytest.approx(3.0 * count ** 0.5, rel=1e-5)  # the norm before clipping
    for p, q in zip(params, before):  # each entry moved by 3 / (3 sqrt(n)): the gradient clipped to norm 1
        assert torch.allclose(q - p.detach(), torch.full_like(p, count ** -0.5), atol=1e-6)
        assert p.grad is None
    sel.grad_clip = 0.0
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    before = [p.detach().clone() for p in params]
    assert torch.isnan(torch.tensor(sel._step(sel.score_opt, params)))  # no clip, no norm
    assert all(torch.allclose(q - p.detach(), torch.full_like(p, 3.0)) for p, q in zip(params, before))


def test_flat_and_unflat_are_inverse_and_a_missing_gradient_is_zeros():
    from rl.methods.bliss.core import flat, unflat
    like = [torch.zeros(2, 3), torch.zeros(4)]
    v = flat([torch.arange(6.0).view(2, 3), None], like)
    assert v.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]
    parts = unflat(torch.arange(10.0), like)
    assert [p.shape for p in parts] == [(2, 3), (4,)] and parts[1].tolist() == [6, 7, 8, 9]
    assert torch.equal(flat(parts, like), torch.arange(10.0))


def test_an_outer_steps_metrics_are_the_quantities_they_name():
    from rl.methods.bliss.core import sequence_stats
    proxy, score, batch, val, target_logp = _setup()
    sel = BilevelSelector(proxy, score, **HYPER)
    weights = global_softmax(sel.scores(batch), sel.col)
    metrics = sel.outer_step(batch, val, target_logp)
    assert set(metrics) == {"lower_loss", "val_ce", "z_norm", "score_grad_norm", "weight_max"}
    assert metrics["weight_max"] == pytest.approx(float(weights.max()))  # the weights the inner steps used
    with torch.no_grad():  # the proxy after its inner steps (the score step leaves it alone)
        assert metrics["val_ce"] == pytest.approx(float(sequence_stats(proxy, val)[0].mean()), rel=1e-5)
        assert metrics["lower_loss"] == pytest.approx(float(sel.lower_level_loss(batch, weights, target_logp)[0]),
                                                      rel=1e-5)
    assert metrics["z_norm"] > 0 and 0 < metrics["score_grad_norm"] < float("inf")


def test_solve_z_clips_each_step_to_norm_one_by_default():
    z = solve_z(lambda v: 0 * v, torch.tensor([3.0, 4.0]), loops=1, lr_z=1.0, lamb=0.0, init=torch.zeros(2))
    assert torch.allclose(z, torch.tensor([0.6, 0.8]))  # the step (3, 4), norm 5, clipped to norm 1


def test_unflat_walks_every_tensor_in_order():
    from rl.methods.bliss.core import unflat
    parts = unflat(torch.arange(9.0), [torch.zeros(2), torch.zeros(3), torch.zeros(4)])
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3, 4], [5, 6, 7, 8]]


def test_the_score_model_reads_each_rows_last_real_token_whatever_the_padding():
    """A row scored inside a padded batch (prompts of other lengths, left-padded; responses right-padded) gets the
    score it gets alone: the attention mask and the positions are the row's, the readout its last real token."""
    proxy, score, batch, *_ = _setup()
    together = score(**batch.model_inputs())
    assert bool((batch.prompt_mask == 0).any()) and bool((batch.response_attn == 0).any())  # padding on both sides
    for i in range(len(batch)):
        p, r = batch.prompt_mask[i].bool(), batch.response_attn[i].bool()
        ids = torch.cat([batch.prompt_ids[i][p], batch.response_ids[i][r]])[None]
        alone = score(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(ids.shape[1])[None])
        assert float(alone.detach()) == pytest.approx(float(together[i].detach()), abs=1e-5), i
    # the readout: the head on the hidden state of each row's last real token
    inputs = batch.model_inputs()
    h = score.backbone(**inputs).last_hidden_state
    last = [int(row.nonzero().max()) for row in inputs["attention_mask"]]
    assert last != [inputs["attention_mask"].shape[1] - 1] * len(batch)  # right padding: not simply the last column
    expected = torch.sigmoid(score.head(h[torch.arange(len(batch)), last]).squeeze(-1))
    assert torch.allclose(together, expected, atol=1e-6)


def test_the_inner_steps_descend_the_whole_lower_level_with_its_kl():
    """The proxy's inner step is AdamW on G = weighted CE + gamma KL + ridge under the score model's weights: the
    same step taken by hand on that loss; a step on the CE alone lands elsewhere."""
    proxy, score, batch, val, target_logp = _setup()
    hyper = {**HYPER, "gamma": 5.0, "inner_steps": 1}
    by_hand = {}
    for target in (target_logp, None):
        copy_proxy = copy.deepcopy(proxy)
        ref = BilevelSelector(copy_proxy, copy.deepcopy(score), **hyper)
        weights = global_softmax(ref.scores(batch), ref.col)
        ref.lower_level_loss(batch, weights, target)[0].backward()
        ref._step(ref.opt, ref.params)
        by_hand[target is None] = [p.detach().clone() for p in ref.params]
    sel = BilevelSelector(proxy, score, **hyper)
    sel.outer_step(batch, val, target_logp)
    assert all(torch.allclose(p, q, atol=1e-7) for p, q in zip(sel.params, by_hand[False]))
    assert not all(torch.allclose(p, q, atol=1e-7) for p, q in zip(sel.params, by_hand[True]))


def test_the_kl_term_is_per_global_token_even_for_a_single_one():
    """One trained token: the KL is divided by 1 (the count is clamped at 1 only to guard an empty batch)."""
    from rl.batch import Batch
    probs = torch.tensor([[[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]])
    target = torch.tensor([[[0.25, 0.25, 0.5], [0.2, 0.3, 0.5]]]).log()
    mask = torch.tensor([[1.0, 0.0]])
    batch = Batch(prompt_ids=torch.ones(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.long),
                  response_ids=torch.tensor([[0, 2]]), response_mask=mask, response_attn=mask.long(),
                  group_id=torch.zeros(1, dtype=torch.long))
    model = _FixedLogits(probs.log())
    model.weight = torch.nn.Parameter(torch.zeros(1))  # something for the optimizers to hold
    sel = BilevelSelector(model, model, gamma=1.0, reg=0.0)
    loss, ce = sel.lower_level_loss(batch, torch.ones(1), target)
    ln2 = float(torch.log(torch.tensor(2.0)))
    assert float(ce) == pytest.approx(ln2, rel=1e-6) and float(loss) == pytest.approx(ln2 + 0.25 * ln2, rel=1e-6)


def test_the_hessian_products_of_the_outer_step_include_the_kl_to_the_target():
    """The z-solve's H z is the Hessian of the whole lower level G (weighted CE + gamma KL + ridge) at the proxy the
    inner steps left, against central differences of its gradient (float64)."""
    import rl.methods.bliss.core as core
    proxy, score, _, val, _ = _setup()
    tok = build_tiny_tokenizer()
    # rows without padding: float64 eager attention turns fully masked padding rows into NaN
    batch = batch_of_examples([prompt_response_example(tok, p, r) for p, r in
                               (("1+2=", "3"), ("4+5=", "9"), ("2*3=", "6"), ("8-5=", "3"))], tok.pad_token_id)
    assert bool(batch.prompt_mask.all()) and bool(batch.response_attn.all())
    target = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1).double()
    proxy, score = proxy.double(), score.double()
    with torch.no_grad():
        P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        target_logp = torch.log_softmax(target(**batch.model_inputs()).logits[:, P - 1:P - 1 + L], -1)
    sel = BilevelSelector(proxy, score, **{**HYPER, "gamma": 5.0, "inner_steps": 1})
    weights = global_softmax(sel.scores(batch), sel.col)
    seen = {}

    def spy(hvp, f_y, *args, **kwargs):
        seen["hvp"] = hvp
        return solve_z(hvp, f_y, *args, **kwargs)
    core.solve_z, real = spy, core.solve_z
    try:
        sel.outer_step(batch, val, target_logp)
    finally:
        core.solve_z = real
    v = torch.randn(sum(p.numel() for p in sel.params), dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    hz = seen["hvp"](v)  # before the differences below move the parameters in place

    def grad_at(shift, target):
        with torch.no_grad():
            for p, d in zip(sel.params, core.unflat(shift, sel.params)):
                p.add_(d)
        g = core.flat(torch.autograd.grad(sel.lower_level_loss(batch, weights, target)[0], sel.params), sel.params)
        with torch.no_grad():
            for p, d in zip(sel.params, core.unflat(shift, sel.params)):
                p.sub_(d)
        return g
    eps = 1e-5
    fd = (grad_at(eps * v, target_logp) - grad_at(-eps * v, target_logp)) / (2 * eps)
    assert float((hz - fd).norm() / fd.norm()) < 1e-3  # central differences: 1e-4 apart at eps 1e-5
    ce_only = (grad_at(eps * v, None) - grad_at(-eps * v, None)) / (2 * eps)
    assert float((hz - ce_only).norm() / fd.norm()) > 1e-2  # the KL's curvature is a visible part of it
