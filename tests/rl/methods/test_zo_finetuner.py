"""ZO Fine-tuner (rl/methods/zo_finetuner/optimizer.py): the spec's tests (rl/methods/zo_finetuner/README.md) on tiny models made in code."""

import copy

import pytest
import torch
from torch import nn

from rl.methods.zo_finetuner.optimizer import (
    PertBundle,
    ZOFinetuner,
    effective_sizes,
    learn_to_learn,
    normalization,
    virtual_step_loss,
)
from rl.optim import MeZO


def _task(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(-1) > 0).long()
    return x, y


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _loss(forward, batch):
    x, y = batch
    return nn.functional.cross_entropy(forward(x), y)


def _constant_bundle(model: nn.Module, value: float) -> PertBundle:
    bundle = PertBundle.for_model(model)
    with torch.no_grad():
        for net in bundle.nets:
            net.net[2].weight.zero_()
            net.net[2].bias.fill_(value)
    return bundle


@pytest.mark.parametrize("bundle", [None, "ones"])
def test_with_every_sigma_one_and_normalisation_the_step_is_mezos_bit_for_bit(bundle):
    a, b = _model(), _model()
    batch = _task()
    mezo = MeZO(a.parameters(), lr=1e-2, eps=1e-3, seed=7)
    zo = ZOFinetuner(b.parameters(), lr=1e-2, eps=1e-3, seed=7,
                     bundle=_constant_bundle(b, 1.0) if bundle else None, normalize=True)
    for _ in range(3):
        mezo.step(lambda: _loss(a, batch))
        zo.step(lambda: _loss(b, batch))
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # a constant σ of 3 is normalised back to 1 as well (f = 1/3): the same steps up to rounding
    c = _model()
    scaled = ZOFinetuner(c.parameters(), lr=1e-2, eps=1e-3, seed=7, bundle=_constant_bundle(c, 3.0))
    d = _model()
    mezo_d = MeZO(d.parameters(), lr=1e-2, eps=1e-3, seed=7)
    for _ in range(3):
        scaled.step(lambda: _loss(c, batch))
        mezo_d.step(lambda: _loss(d, batch))
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(c.parameters(), d.parameters()))


def test_each_tensor_steps_along_mezos_direction_scaled_by_its_learned_sigma():
    """One step from the same weights and seed as MeZO: tensor i moves along MeZO's ξ_i (the same generator),
    by an amount proportional to its σ_i from the bundle, so the per-tensor step sizes relate as the σ's do
    (ignoring the learned scales would give every tensor the same factor)."""
    a, b = _model(), _model()
    batch = _task()
    bundle = PertBundle.for_model(b, seed=3)
    sigma = bundle.sigmas(list(b.parameters()), 0.0, 0.0, [1.0] * 4)
    assert float(sigma.max() / sigma.min()) > 1.2  # a shape worth telling apart from MeZO's
    before = [p.detach().clone() for p in a.parameters()]
    MeZO(a.parameters(), lr=1e-2, eps=1e-3, seed=7).step(lambda: _loss(a, batch))
    ZOFinetuner(b.parameters(), lr=1e-2, eps=1e-3, seed=7, bundle=bundle).step(lambda: _loss(b, batch))
    factors = []
    for p0, pa, pb in zip(before, a.parameters(), b.parameters()):
        da, db = pa.detach() - p0, pb.detach() - p0
        c = float((da * db).sum() / (da * da).sum())
        assert torch.allclose(db, c * da, atol=1e-7)  # MeZO's direction ξ_i, rescaled
        factors.append(c)
    ratios = torch.tensor(factors) / factors[0]
    assert torch.allclose(ratios, (sigma / sigma[0]).float(), rtol=1e-3)


def test_parameters_are_restored_after_plus_minus_two_plus():
    model = _model()
    opt = ZOFinetuner(model.parameters(), eps=1e-3, bundle=PertBundle.for_model(model, seed=3))
    before = [p.detach().clone() for p in model.parameters()]
    sigma = opt.bundle.sigmas(list(model.parameters()), 0.0, 0.0, [1.0] * 4)
    opt.scales = [float(x) for x in normalization(sigma, opt.sizes) * sigma]
    assert len(set(opt.scales)) > 1  # a learned shape, not all equal
    for scale in (1.0, -2.0, 1.0):
        opt.perturb(11, scale)
    assert all((p - q).abs().max() <= 1e-7 for p, q in zip(model.parameters(), before))


def test_the_normalisation_holds_at_every_step():
    model = _model()
    batch = _task()
    names = [n for n, _ in model.named_parameters()]
    opt = ZOFinetuner(model.parameters(), lr=1e-2, eps=1e-3, bundle=PertBundle.for_model(model, seed=5),
                      names=names)
    n = torch.tensor(opt.sizes, dtype=torch.float64)
    for _ in range(4):
        opt.step(lambda: _loss(model, batch))
        sigma = torch.tensor(opt.sigma_prev, dtype=torch.float64)
        assert float(opt.norm_factor ** 2 * (n * sigma ** 2).sum()) == pytest.approx(float(n.sum()), rel=1e-5)
    # an embedding counts only the rows a batch touches
    assert effective_sizes(["model.embed_tokens.weight", "lm_head.weight"], [torch.Size([1000, 8])] * 2, 15) == \
        [15 * 8, 8000]


def test_meta_gradients_reach_only_the_pert_nets_and_match_a_finite_difference():
    model = _model().double()
    batch = (_task()[0].double(), _task()[1])
    bundle = PertBundle.for_model(model, seed=1).double()
    params = dict(model.named_parameters())
    theta = {k: v.detach() for k, v in params.items()}
    gen = torch.Generator().manual_seed(0)
    xis = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params.values()]
    sigma = bundle.sigmas(list(params.values()), 0.7, 0.6, [1.0] * 4).double()
    f = normalization(sigma, [p.numel() for p in params.values()]).detach()
    meta = virtual_step_loss(model, _loss, batch, theta, sigma, f, xis, projected=2.5, lr_update=0.05)
    meta.backward()
    assert all(p.grad is None for p in model.parameters())  # the model's weights get nothing
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in bundle.parameters())
    # ∂L(θ′)/∂σ_i against a central difference
    leaf = sigma.detach().clone().requires_grad_(True)
    virtual_step_loss(model, _loss, batch, theta, leaf, f, xis, 2.5, 0.05).backward()
    h = 1e-6
    for i in range(len(leaf)):
        up, down = leaf.detach().clone(), leaf.detach().clone()
        up[i] += h
        down[i] -= h
        fd = (virtual_step_loss(model, _loss, batch, theta, up, f, xis, 2.5, 0.05)
              - virtual_step_loss(model, _loss, batch, theta, down, f, xis, 2.5, 0.05)) / (2 * h)
        assert float(leaf.grad[i]) == pytest.approx(float(fd), rel=1e-5, abs=1e-10)


def test_learn_to_learn_trains_a_bundle_that_saves_loads_and_drives_the_optimizer(tmp_path):
    model = _model()
    batches = [(_task(s)[0], _task(s)[1]) for s in range(12)]
    logs = []
    bundle = learn_to_learn(copy.deepcopy(model), _loss, batches, lr_mlp=0.1, lr_update=1e-2, restart_every=6,
                            log=lambda step, m: logs.append(m))
    assert len(logs) == 12 and all(m["sigma_mean"] > 0 for m in logs)
    fresh = PertBundle.for_model(model)
    assert any(not torch.equal(a, b) for a, b in zip(bundle.state_dict().values(), fresh.state_dict().values()))
    bundle.save(tmp_path / "pert.pt")
    again = PertBundle.load(tmp_path / "pert.pt")
    assert all(torch.equal(a, b) for a, b in zip(bundle.state_dict().values(), again.state_dict().values()))
    from rl.registry import lookup
    opt = lookup("optimizer", "zo_finetuner")(model.parameters(), lr=1e-2, bundle=str(tmp_path / "pert.pt"))
    assert opt.forward_only
    opt.step(lambda: _loss(model, batches[0]))
    assert {"sigma_mean", "norm_factor", "loss_plus", "loss_minus"} <= set(opt.last)
    with pytest.raises(ValueError, match="zo_finetuner bundle: made for 4 tensors, the model has 2"):
        ZOFinetuner(nn.Linear(8, 2).parameters(), bundle=str(tmp_path / "pert.pt"))


def test_the_bundle_carries_the_released_embedding_rows_rule_to_the_optimizer(tmp_path):
    """The stage trains with 15 × batch touched embedding rows unless told otherwise; the saved bundle gives the
    optimizer that estimate, so the normalisation counts an embedding's touched rows only."""
    from rl.methods.zo_finetuner.stage import ZOFinetunerStage
    assert ZOFinetunerStage(batch_size=16).embedding_rows == 240
    assert ZOFinetunerStage(batch_size=16, embedding_rows=7).embedding_rows == 7
    model = nn.Sequential(nn.Embedding(1000, 4), nn.Linear(4, 2))
    model[0].weight.data.normal_()
    names = [n.replace("0.", "embed.", 1) for n, _ in model.named_parameters()]
    bundle = PertBundle(names, [tuple(p.shape) for p in model.parameters()], embedding_rows=240)
    bundle.save(tmp_path / "b.pt")
    opt = ZOFinetuner(model.parameters(), bundle=str(tmp_path / "b.pt"))
    assert opt.sizes == [240 * 4, 8, 2]  # 240 of the 1000 rows
    assert ZOFinetuner(model.parameters(), bundle=str(tmp_path / "b.pt"), embedding_rows=10).sizes == [40, 8, 2]


# CI: the learned optimizer in this file's other tests, MeZO on the learner in
# tests/cluster/test_learner_components.py
@pytest.mark.extended
@pytest.mark.slow
def test_the_learn_to_learn_stage_writes_the_bundle_the_forward_only_sft_reads(ray_cluster, tmp_path):
    """recipes/zo_finetune_tiny.yaml at test size: the zo_finetuner stage writes `pert_bundle`, the SFT stage's
    optimizer reads it through `bundle: artifact:pert_bundle` and steps along its shape (σ ≠ 1)."""
    import json

    from cluster.pipeline import run
    from rl import config
    from tests.cluster.test_pipeline import ROOT
    out = tmp_path / "zo"
    summary = run(config.load(ROOT / "recipes/zo_finetune_tiny.yaml", [
        f"output_dir={out}", "data.synthetic.num_train=200", "data.synthetic.num_eval=8", "sft.steps=4",
        "sft.batch_size=4", "learner.micro_batch_size=4", "trainer.eval_max_prompts=8", "rollout.max_new_tokens=8",
        "logging.progress_bar=false", "logging.tensorboard=false",
        "stages=[{name: model}, {name: data}, {name: zo_finetuner, params: {steps: 6, batch_size: 4, "
        "restart_every: 3, lr_mlp: 0.1, lr_update: 0.01}}, {name: sft}, {name: evaluate}]"]))
    bundle = summary["stages"]["zo_finetuner"]["artifacts"]["pert_bundle"]
    assert (out / "stages" / "zo_finetuner" / "pert_bundle.pt").exists() and bundle.endswith("pert_bundle.pt")
    assert PertBundle.load(bundle).embedding_rows == 60  # 15 x 4
    assert summary["zo_finetuner"]["steps"] == 6
    rows = [json.loads(x) for x in (out / "sft_metrics.jsonl").read_text().splitlines()]
    sigma = [v for r in rows for k, v in r.items() if k.endswith("sigma_mean")]
    assert len(sigma) == 4 and all(abs(s - 1.0) > 1e-6 for s in sigma)  # the learned shape, not MeZO's σ = 1
    assert "accuracy_after_rl" in summary


class _Embedded(nn.Module):
    """An embedding (its name has "embed": the touched-rows estimate applies) and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(12, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x).mean(1)))


def _embedded_batches(n: int):
    g = torch.Generator().manual_seed(5)
    for _ in range(n):
        x = torch.randint(0, 12, (6, 3), generator=g)
        yield x, (x.sum(1) % 2)


def _reference_learn_to_learn(model, batches, *, eps, lr_update, lr_mlp, lr_llm, momentum, restart_every, hidden,
                              normalize, embedding_rows, seed):
    """learn_to_learn written out step by step from its description: the ZO losses at θ ± eps·f·σ⊙ξ (ξ from the
    step's seed), the meta-loss L(θ − lr_update·((L+ − L−)/2eps)·f·σ⊙ξ) back-propagated into the networks alone
    (plain SGD at lr_mlp), then the model's own SGD step with momentum at a rate decayed linearly within each
    period, restarted (weights and momentum) every `restart_every` steps."""
    from torch.func import functional_call
    names = [n for n, p in model.named_parameters()]
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    initial = {n: t.clone() for n, t in theta.items()}
    bundle = PertBundle.for_model(model, hidden, seed, embedding_rows)
    sizes = effective_sizes(names, [t.shape for t in theta.values()], embedding_rows)
    loss_at = lambda params, batch: _loss(lambda x: functional_call(model, params, (x,)), batch)  # noqa: E731
    history, sigma_prev, velocity, logs = (0.0, 0.0), [1.0] * len(names), None, []
    for step, batch in enumerate(batches):
        if step % restart_every == 0:
            theta, velocity = {n: t.clone() for n, t in initial.items()}, None
        lr = lr_llm * (1 - (step % restart_every) / restart_every)
        sigma = bundle.sigmas(list(theta.values()), *history, sigma_prev)
        f = normalization(sigma.detach(), sizes) if normalize else torch.tensor(1.0)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        xis = [torch.randn(t.shape, generator=gen) for t in theta.values()]
        s = [float(x) for x in f * sigma.detach()]
        with torch.no_grad():
            plus = float(loss_at({n: t + eps * si * xi for (n, t), si, xi in zip(theta.items(), s, xis)}, batch))
            minus = float(loss_at({n: t - eps * si * xi for (n, t), si, xi in zip(theta.items(), s, xis)}, batch))
        projected = (plus - minus) / (2 * eps)
        meta = loss_at({n: t - lr_update * projected * f * sg * xi
                        for (n, t), sg, xi in zip(theta.items(), sigma, xis)}, batch)
        bundle.zero_grad()
        meta.backward()
        with torch.no_grad():
            for q in bundle.parameters():
                q -= lr_mlp * q.grad
        leaves = {n: t.clone().requires_grad_(True) for n, t in theta.items()}
        loss = loss_at(leaves, batch)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        velocity = list(grads) if velocity is None else [momentum * v + g for v, g in zip(velocity, grads)]
        theta = {n: (t - lr * v).detach() for (n, t), v in zip(theta.items(), velocity)}
        logs.append({"loss": float(loss), "meta_loss": float(meta), "sigma_mean": float(sigma.detach().mean()),
                     "norm_factor": float(f)})
        history, sigma_prev = (plus, minus), [float(x) for x in sigma.detach()]
    return theta, bundle, logs


@pytest.mark.parametrize("settings", [
    dict(eps=1e-2, lr_update=0.5, lr_mlp=0.05, lr_llm=0.2, momentum=0.5, restart_every=2, hidden=8,
         normalize=True, embedding_rows=2, seed=3),
    dict(eps=1e-2, lr_update=0.5, lr_mlp=0.05, lr_llm=0.2, momentum=0.5, restart_every=3, hidden=8,
         normalize=False, embedding_rows=None, seed=1),
    None])  # None: the documented defaults, over 102 steps (a restart at step 100)
def test_learn_to_learn_follows_its_description_step_by_step(settings):
    defaults = dict(eps=1e-3, lr_update=1e-6, lr_mlp=1e-3, lr_llm=0.01, momentum=0.8, restart_every=100, hidden=64,
                    normalize=True, embedding_rows=None, seed=0)
    steps = 102 if settings is None else 5
    reference_model, model = _Embedded(), _Embedded()
    theta, ref_bundle, ref_logs = _reference_learn_to_learn(reference_model, _embedded_batches(steps),
                                                            **(settings or defaults))
    logs = []
    bundle = learn_to_learn(model, _loss, _embedded_batches(steps), log=lambda step, m: logs.append((step, m)),
                            **(settings or {}))
    assert [step for step, _ in logs] == list(range(steps))
    for (_, got), want in zip(logs, ref_logs):
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7) for k in want)
    for n, p in model.named_parameters():
        assert torch.allclose(p.detach(), theta[n], atol=1e-6), n
    for a, b in zip(bundle.parameters(), ref_bundle.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert bundle.embedding_rows == (settings or defaults)["embedding_rows"] and bundle.hidden == \
        (settings or defaults)["hidden"]


def test_without_a_bundle_it_is_mezo_with_mezos_defaults_and_the_settings_given():
    a, b = _model(), _model()
    batch = _task()
    for opts in ({}, dict(lr=1e-2, eps=1e-2, weight_decay=0.1, seed=4)):
        mezo, zo = MeZO(a.parameters(), **{**dict(lr=1e-6, eps=1e-3, weight_decay=0.0, seed=0), **opts}), \
            ZOFinetuner(b.parameters(), **opts)
        for _ in range(2):
            mezo.step(lambda: _loss(a, batch))
            zo.step(lambda: _loss(b, batch))
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_constant_unnormalised_sigma_scales_mezos_perturbation_by_itself():
    a, b = _model(), _model()
    before = [p.detach().clone() for p in a.parameters()]
    MeZO(a.parameters(), eps=1e-3).perturb(9, 1.0)
    zo = ZOFinetuner(b.parameters(), eps=1e-3, bundle=_constant_bundle(b, 2.0), normalize=False)
    zo.scales = [2.0] * 4  # what step() sets from the bundle's σ = 2 without normalisation
    zo.perturb(9, 1.0)
    for p0, pa, pb in zip(before, a.parameters(), b.parameters()):
        assert torch.allclose(pb - p0, 2 * (pa - p0), atol=1e-7)
    assert not any(q.requires_grad for q in zo.bundle.parameters())  # the bundle is frozen while it drives steps


def test_the_names_given_decide_which_tensor_is_an_embedding():
    model = _model()
    bundle = PertBundle(["a", "b", "c", "d"], [tuple(p.shape) for p in model.parameters()], embedding_rows=2)
    opt = ZOFinetuner(model.parameters(), bundle=bundle, names=["embed.weight", "b", "c", "d"])
    assert opt.sizes == [2 * 8, 16, 32, 2]  # 2 of the first tensor's 16 rows; the bundle's own names say none


def test_bundle_defaults_widths_and_a_saved_bundle_comes_back_as_made(tmp_path):
    from rl.methods.zo_finetuner.optimizer import PertNet
    model = _model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    made = PertBundle.for_model(model)
    same = PertBundle(names, shapes, 64, 0)
    assert made.hidden == 64 and PertNet().net[0].out_features == 64
    assert all(torch.equal(x, y) for x, y in zip(made.state_dict().values(), same.state_dict().values()))
    assert all(torch.equal(x, y) for x, y in zip(PertBundle(names, shapes).state_dict().values(),
                                                 same.state_dict().values()))  # seed 0 by default
    narrow = PertBundle.for_model(model, hidden=8, seed=2, embedding_rows=5)
    assert narrow.hidden == 8 and narrow.nets[0].net[0].out_features == 8
    narrow.save(tmp_path / "b.pt")
    back = PertBundle.load(tmp_path / "b.pt")
    assert (back.names, back.shapes, back.hidden, back.embedding_rows) == (names, shapes, 8, 5)
    assert all(torch.equal(x, y) for x, y in zip(back.state_dict().values(), narrow.state_dict().values()))


def test_a_bundle_made_for_other_tensors_is_refused_naming_the_first_difference():
    model = _model()
    bundle = PertBundle.for_model(model)
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    with pytest.raises(ValueError) as err:
        ZOFinetuner(other.parameters(), bundle=bundle)
    assert str(err.value) == ("zo_finetuner bundle: made for 4 tensors, the model has 4; first difference at tensor 2 "
                              "(2.weight: bundle (2, 16), model (3, 16))")
    with pytest.raises(ValueError) as err:
        ZOFinetuner(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2), nn.Linear(2, 2)).parameters(),
                    bundle=bundle)
    assert str(err.value) == ("zo_finetuner bundle: made for 4 tensors, the model has 6; first difference at tensor 4 "
                              "(-: bundle None, model (2, 2))")
    with pytest.raises(ValueError) as err:
        ZOFinetuner(nn.Linear(8, 16).parameters(), bundle=bundle)
    assert str(err.value) == ("zo_finetuner bundle: made for 4 tensors, the model has 2; first difference at tensor 2 "
                              "(2.weight: bundle (2, 16), model None)")


def test_pert_features_are_mean_variance_losses_and_previous_sigma():
    from rl.methods.zo_finetuner.optimizer import pert_features
    one = pert_features(torch.tensor([3.0]), 1.5, 0.5, 2.0)
    assert one.tolist() == [3.0, 0.0, 1.5, 0.5, 2.0]  # a one-element tensor has variance 0, not NaN
    two = pert_features(torch.tensor([1.0, 3.0]), 0.0, 0.0, 1.0)
    assert two.tolist() == [2.0, 2.0, 0.0, 0.0, 1.0]  # unbiased variance of two values


def test_the_virtual_step_passes_keyword_inputs_through():
    """The meta-loss with a loss that calls the model by keyword (as `forward(**batch)` of a transformers model):
    the same value as by hand at θ′ = θ − lr·proj·f·σ⊙ξ."""
    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x=None):
            return self.lin(x)
    torch.manual_seed(0)
    model, batch = Keyword(), _task()
    params = {n: p.detach() for n, p in model.named_parameters()}
    xis = [torch.randn_like(p) for p in params.values()]
    sigma, f = torch.tensor([0.5, 2.0]), torch.tensor(1.5)
    loss = virtual_step_loss(model, lambda fwd, b: nn.functional.cross_entropy(fwd(x=b[0]), b[1]), batch, params,
                             sigma, f, xis, projected=0.3, lr_update=0.1)
    w = params["lin.weight"] - 0.1 * 0.3 * 1.5 * 0.5 * xis[0]
    bias = params["lin.bias"] - 0.1 * 0.3 * 1.5 * 2.0 * xis[1]
    assert float(loss) == pytest.approx(float(nn.functional.cross_entropy(batch[0] @ w.T + bias, batch[1])), rel=1e-6)
