"""Reward models: the Bradley–Terry loss by hand, the `reward_model` stage training a tiny one through the
DeepSpeed learner, and the `reward_model` reward serving it from a judge group through the reward service."""

import json
import random

import pytest
import torch

from rl import config
from rl.losses import bradley_terry_loss
from tests.cluster.test_pipeline import ROOT, TINY


def test_bradley_terry_loss_by_hand():
    # pairs (2, 0) and (1, 1): -log sigmoid(2) = 0.126928, -log sigmoid(0) = 0.693147; mean 0.410038
    loss, m = bradley_terry_loss(torch.tensor([2.0, 0.0, 1.0, 1.0]), torch.ones(4, 1), num_seqs=4.0)
    assert float(loss) == pytest.approx(0.410038, abs=1e-6)
    assert m["pair_accuracy"] == 0.5
    # global normalisation: half the pairs on this rank, num_seqs of the whole batch
    half, _ = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.ones(2, 1), num_seqs=4.0)
    assert float(half) == pytest.approx(0.126928 / 2, abs=1e-6)
    with pytest.raises(ValueError, match="pairs"):
        bradley_terry_loss(torch.zeros(3), torch.ones(3, 1))


def _pairs(n, seed):
    """Preferences over answers to a+b=: the right sum is chosen, a wrong one rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        wrong = rng.choice([s for s in range(19) if s != a + b])
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    return rows


def _classifier_judge(path, workers):
    """A judge group's settings (as `reward.judges.<name>` resolves them) serving the reward model at `path`."""
    return {"model_path": path, "engine": "hf_classifier", "engine_params": {}, "dtype": "float32", "num_cpus": 0,
            "num_gpus": 0, "threads": 1, "chat_template": False, "num_workers": workers, "temperature": 0.0,
            "top_p": 1.0, "max_new_tokens": 1}


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    for name, rows in (("train.jsonl", _pairs(2000, 0)), ("heldout.jsonl", _pairs(200, 1))):
        (tmp / name).write_text("\n".join(json.dumps(r) for r in rows))
    from cluster.pipeline import run
    stage = (f"{{name: reward_model, params: {{data: '{tmp / 'train.jsonl'}', eval_data: '{tmp / 'heldout.jsonl'}', "
             f"steps: 300, batch_pairs: 32, lr: 2.0e-3}}}}")
    cfg = config.load(ROOT / "recipes/quickstart.yaml", [f"output_dir={tmp / 'run'}", *TINY,
                                                         f"stages=[{{name: model}}, {stage}]"])
    return run(cfg), tmp


@pytest.mark.slow
def test_the_reward_model_stage_learns_to_rank_held_out_pairs(trained):
    summary, tmp = trained
    rm = summary["reward_model"]
    assert rm["heldout_pairs"] == 200 and rm["loss_last"] < rm["loss_first"]
    assert rm["heldout_pair_accuracy"] > 0.75  # chance is 0.5
    assert summary["stages"]["reward_model"]["artifacts"]["reward_model"] == str(tmp / "run" / "reward_model")


@pytest.mark.slow
def test_the_reward_model_reward_serves_it_batched_with_the_models_own_scores(trained):
    """Through a judge group (two hf_classifier workers) and the reward service: the same scores as the
    model's forward on the same tokens, called directly."""
    import ray

    from cluster.ray_utils import actor_env
    from models.families import SequenceScoreFamily
    from models.tokenizer import load_tokenizer
    from rewards.judges import start_judges
    from rewards.scoring import RewardSpec
    from rewards.service import RewardService
    from rl.sft_data import make_sft_batch
    _, tmp = trained
    path = str(tmp / "run" / "reward_model")
    rows = _pairs(10, 2)
    prompts, responses = [r["prompt"] for r in rows] * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    clients = start_judges({"rm": _classifier_judge(path, workers=2)}, path, env=actor_env())
    service = ray.remote(RewardService).remote([RewardSpec("reward_model", 1.0, {"judge": "rm"})], num_workers=1)
    try:
        ray.get(service.set_judges.remote(clients))
        out = ray.get(service.score.remote([{"prompt": p, "response": r, "ground_truth": None, "metadata": {}}
                                            for p, r in zip(prompts, responses)]))
    finally:
        ray.kill(service)
        for w in clients["rm"].workers:
            ray.kill(w)
    family = SequenceScoreFamily()
    model = family.load(path).eval()
    with torch.no_grad():
        direct = family.forward(model, make_sft_batch(load_tokenizer(path), prompts, responses))["scores"]
    assert not any(o["failed"] for o in out)
    assert torch.allclose(torch.tensor([o["score"] for o in out]), direct, atol=1e-5)
    assert (direct[:10] > direct[10:]).float().mean() > 0.6  # chosen above rejected, as trained


def test_step_spans_map_character_ends_to_tokens():
    from models.tiny import build_tiny_tokenizer
    from rl.sft_data import make_sft_batch
    from rl.step import step_spans
    tok = build_tiny_tokenizer()  # one token per character, then EOS
    b = make_sft_batch(tok, ["q", "q"], ["ab\ncd", "xyz"])
    spans = step_spans(b, [[3, 5], []], tok)
    assert spans[0, :6].tolist() == [0, 0, 0, 1, 1, 1]  # "ab\n" | "cd" and the EOS
    assert (spans[1] == -1).all()  # no steps reported: no map


@pytest.mark.slow
def test_the_process_reward_model_scores_every_step_prefix_and_fills_the_step_fields(trained):
    import ray

    from cluster.ray_utils import actor_env
    from models.tiny import build_tiny_tokenizer
    from rewards.judges import start_judges
    from rewards.scoring import RewardSpec
    from rewards.service import RewardService
    from rl.sft_data import make_sft_batch
    from rl.step import attach_rewards
    from rollout.classifier_engine import ClassifierEngine
    _, tmp = trained
    path = str(tmp / "run" / "reward_model")
    prompts, responses = ["3+4=", "5+5="], ["7\n7", "1\n0\n10"]
    clients = start_judges({"rm": _classifier_judge(path, workers=1)}, path, env=actor_env())
    service = ray.remote(RewardService).remote([RewardSpec("process_reward_model", 1.0, {"judge": "rm"})],
                                               num_workers=1)
    try:
        ray.get(service.set_judges.remote(clients))
        scored = ray.get(service.score.remote([{"prompt": p, "response": r, "ground_truth": None, "metadata": {}}
                                               for p, r in zip(prompts, responses)]))
    finally:
        ray.kill(service)
        ray.kill(clients["rm"].workers[0])
    engine = ClassifierEngine(path)
    assert scored[0]["steps"]["ends"] == [2, 3] and scored[1]["steps"]["ends"] == [2, 4, 6]
    direct = engine.score(["3+4=", "3+4=", "5+5=", "5+5=", "5+5="], ["7\n", "7\n7", "1\n", "1\n0\n", "1\n0\n10"])
    got = scored[0]["steps"]["rewards"] + scored[1]["steps"]["rewards"]
    assert torch.allclose(torch.tensor(got), torch.tensor(direct), atol=1e-5)
    assert scored[1]["score"] == pytest.approx(direct[-1], abs=1e-5)
    batch = make_sft_batch(build_tiny_tokenizer(), prompts, responses)
    attach_rewards(batch, scored, build_tiny_tokenizer())
    assert batch.step_rewards == [scored[0]["steps"]["rewards"], scored[1]["steps"]["rewards"]]
    assert batch.token_step[1, :7].tolist() == [0, 0, 1, 1, 2, 2, 2]  # "1\n" | "0\n" | "10" + EOS
