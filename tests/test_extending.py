"""The worked examples of `docs/extending.md` (recipes/extending/): each plugin through the registry
the way a recipe names it, with hand-computed values, and the recipe that uses them all, end to end."""

from pathlib import Path

import pytest
import torch

from rl.registry import lookup

ROOT = Path(__file__).resolve().parents[1]
EXT = ROOT / "recipes" / "extending"


def plugin(kind, file, attr):
    return lookup(kind, f"{EXT / file}:{attr}")


def test_reward_example():
    brevity = plugin("reward", "reward.py", "brevity")
    assert brevity("p", "x" * 24, max_chars=24)["score"] == 1.0
    assert brevity("p", "x" * 36, max_chars=24)["score"] == 0.5
    assert brevity("p", "x" * 60, max_chars=24) == {"score": 0.0, "chars": 60.0}


def test_advantage_example():
    rank = plugin("advantage", "advantage.py", "group_rank")
    # one group of four: rewards 1, 0, 0, 1 → mean ranks 2.5, 0.5, 0.5, 2.5 of 0..3 → ±2/3
    adv = rank(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 0, 1]), torch.ones(5, 2))
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0])
    assert torch.equal(adv[:, 0], adv[:, 1])


def test_loss_example():
    reinforce = plugin("loss", "loss.py", "reinforce")
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = reinforce(logp, logp, adv, mask, num_tokens=3.0)
    assert float(loss) == pytest.approx((1 + 2 - 1) / 3)  # −A·logp summed over the 3 tokens / 3


def test_optimizer_example():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = plugin("optimizer", "optimizer.py", "sgd")([p], lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        (2 * p).sum().backward()
        opt.step()
    assert float(p.detach()) == pytest.approx(1 - 0.1 * 2 - 0.1 * (0.9 * 2 + 2))  # momentum buffer 2, then 3.8


def test_env_example():
    env = plugin("env", "env.py", "GuessTheAnswer")()
    assert env.reset("12+3*4=", {"answer": "24"}, None) == "12+3*4="
    assert env.step("20").observation == " higher\n" and env.step("30").observation == " lower\n"
    assert env.step("what").observation == " number?\n"
    done = env.step("it is 24")
    assert done.done and done.reward == 1.0


def test_decoding_example(tmp_path):
    from models.tiny import save_tiny
    from rollout.base import SamplingParams
    from rollout.hf_engine import HFEngine
    engine = HFEngine(str(save_tiny(tmp_path, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)))
    spec = f"{EXT / 'decoding.py'}:NoImmediateRepeat"
    b = engine.generate(["1+1=", "22"], SamplingParams(n=4, max_new_tokens=20, seed=1, decoding=spec))
    for i in range(len(b)):
        ids = b.response_ids[i, : int(b.response_attn[i].sum())].tolist()
        assert all(x != y for x, y in zip(ids, ids[1:]))


@pytest.mark.slow
def test_the_extending_recipe_runs_every_plugin_end_to_end(ray_cluster, tmp_path, monkeypatch):
    from cluster.pipeline import run
    from rl import config
    from rl.loop.tracking import read_metrics
    monkeypatch.chdir(ROOT)  # the recipe names its plugins relative to the repository root
    cfg = config.load(EXT / "custom.yaml", [f"output_dir={tmp_path / 'ext'}", "trainer.steps=2",
                                            "logging.progress_bar=false", "logging.tensorboard=false"])
    summary = run(cfg)
    metrics = read_metrics(tmp_path / "ext")
    assert summary["steps"] == 2 and summary["selected_train_rows"] == summary["rl_train_rows"] == 100  # half of 200
    assert "accuracy_after_rl" in summary and "reward/recipes/extending/reward.py:brevity" in metrics[0]
    assert all(m["env/turns_mean"] >= 1 and m["actor/grad_norm"] > 0 for m in metrics)
