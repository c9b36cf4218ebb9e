import pytest
import torch

from rl.advantages import compute_grpo_advantages, group_stats
from rl.registry import lookup


def test_grpo_hand_values_unbiased_std():
    # rl/methods/rltt/README.md: rewards [1,0,0,1] -> unbiased std 0.57735, advantages ±0.86602
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.ones(4, 3)
    adv = compute_grpo_advantages(r, torch.zeros(4, dtype=torch.long), mask)
    assert adv.shape == (4, 3)
    expected = torch.tensor([0.866024, -0.866024, -0.866024, 0.866024])
    assert torch.allclose(adv[:, 0], expected, atol=1e-5)
    _, std, _ = group_stats(r, torch.zeros(4, dtype=torch.long))
    assert std[0].item() == pytest.approx(0.57735, abs=1e-5)


def test_grpo_eps_is_added_to_std():
    r = torch.tensor([1.0, 0.0])
    adv = compute_grpo_advantages(r, torch.zeros(2, dtype=torch.long), torch.ones(2, 1), eps=0.5)
    std = 2 ** -0.5  # unbiased std of {1, 0}
    assert adv[0, 0].item() == pytest.approx(0.5 / (std + 0.5), rel=1e-6)


def test_grpo_all_equal_group_and_group_of_one_are_zero():
    r = torch.tensor([1.0, 1.0, 1.0, 0.3])
    gid = torch.tensor([0, 0, 0, 1])
    adv = compute_grpo_advantages(r, gid, torch.ones(4, 2))
    assert torch.equal(adv, torch.zeros(4, 2))
    assert not torch.isnan(adv).any()


def test_grpo_groups_are_independent_and_masked():
    r = torch.tensor([1.0, 0.0, 5.0, 7.0])
    gid = torch.tensor([3, 3, 9, 9])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    adv = compute_grpo_advantages(r, gid, mask)
    assert torch.allclose(adv[:, 0], torch.tensor([0.707106, -0.707106, -0.707106, 0.707106]), atol=1e-5)
    assert torch.equal(adv[:, 2], torch.zeros(4))


def test_dr_grpo_is_mean_centring_only():
    # SkyRL's hand case: groups [6,3] and [9,12] -> [1.5,-1.5,-1.5,1.5] without std division
    r = torch.tensor([6.0, 3.0, 9.0, 12.0])
    adv = compute_grpo_advantages(r, torch.tensor([0, 0, 1, 1]), torch.ones(4, 1), norm_by_std=False)
    assert torch.allclose(adv[:, 0], torch.tensor([1.5, -1.5, -1.5, 1.5]))


def test_grpo_is_registered():
    assert lookup("advantage", "grpo") is compute_grpo_advantages


def test_rloo_skyrl_hand_values():
    # groups [6,3], [9,12], [1] -> [3,-3,-3,3,0]
    from rl.advantages import compute_rloo_advantages
    r = torch.tensor([6.0, 3.0, 9.0, 12.0, 1.0])
    adv = compute_rloo_advantages(r, torch.tensor([0, 0, 1, 1, 2]), torch.ones(5, 2))
    assert torch.allclose(adv[:, 0], torch.tensor([3.0, -3.0, -3.0, 3.0, 0.0]))
    # leave-one-out: R_i - mean of the others, group of three
    adv3 = compute_rloo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long), torch.ones(3, 1))
    assert torch.allclose(adv3[:, 0], torch.tensor([1.0, -0.5, -0.5]))


def test_dr_grpo_registered_equals_grpo_without_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2])
    gid = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.ones(6, 3)
    assert torch.equal(lookup("advantage", "dr_grpo")(r, gid, mask),
                       compute_grpo_advantages(r, gid, mask, norm_by_std=False))


def test_reinforce_pp_whitens_returns_over_batch_tokens():
    from rl.advantages import compute_reinforce_pp_advantages
    # one token each, rewards [1, 0]: mean 0.5, unbiased std 0.7071
    adv = compute_reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), torch.ones(2, 1))
    assert torch.allclose(adv[:, 0], torch.tensor([0.707107, -0.707107]), atol=1e-5)
    # A: 2 tokens, reward 1; B: 1 token, reward 0 -> token values [1,1,0]: mean 2/3, unbiased std 0.57735
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = compute_reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask)
    assert torch.allclose(adv, torch.tensor([[0.57735, 0.57735], [-1.154701, 0.0]]), atol=1e-5)


def test_discounted_outcome_returns():
    from rl.advantages import discounted_outcome_returns
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ret = discounted_outcome_returns(torch.tensor([2.0]), mask, gamma=0.5)
    assert torch.allclose(ret, torch.tensor([[0.5, 1.0, 2.0, 0.0]]))


def test_reinforce_pp_baseline_hand_values():
    from rl.advantages import compute_reinforce_pp_baseline_advantages
    # group means remove [0.5,0.5] and [1,1] -> [0.5,-0.5,0,0]; whitened: mean 0, unbiased var 1/6
    adv = compute_reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                                                   torch.ones(4, 1))
    assert torch.allclose(adv[:, 0], torch.tensor([1.224745, -1.224745, 0.0, 0.0]), atol=1e-5)


def test_grpo_passk_credits_only_the_best_sample():
    from rl.advantages import compute_grpo_passk_advantages
    r = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 7.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = compute_grpo_passk_advantages(r, gid, torch.ones(6, 1), norm_by_std=False)
    assert torch.allclose(adv[:, 0], torch.tensor([0.0, 0.4, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)
    normed = compute_grpo_passk_advantages(r, gid, torch.ones(6, 1))
    std = torch.tensor([0.2, 0.9, 0.5]).std().item()
    assert normed[1, 0].item() == pytest.approx(0.4 / (std + 1e-6), rel=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "grpo_passk"])
def test_every_estimator_masks_tokens_and_handles_all_equal(name):
    fn = lookup("advantage", name)
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    adv = fn(torch.ones(4), torch.tensor([0, 0, 1, 1]), mask)
    assert adv.shape == (4, 3) and not torch.isnan(adv).any()
    assert torch.equal(adv[:, 2], torch.zeros(4))
    if name != "reinforce_pp":  # group-relative estimators: all-equal groups carry no signal
        assert torch.allclose(adv, torch.zeros(4, 3))


# ---------------------------------------------------------------------- MGPO (rl/methods/agentic_proposing/README.md, a reconstruction)
def test_mgpo_trajectory_reward_gate_and_difficulty():
    from rl.methods.agentic_proposing.reward import mgpo_trajectory_reward
    assert mgpo_trajectory_reward(False, True, 0.25) == 0.0  # invalid: zero total reward
    assert mgpo_trajectory_reward(True, True, 0.25) == pytest.approx(0.1 + 1.0 + 0.75)  # D = 1 - 0.25
    assert mgpo_trajectory_reward(True, True, 0.0) == pytest.approx(1.1)  # unsolvable: no bonus
    assert mgpo_trajectory_reward(True, False, 0.5, difficulty="band") == pytest.approx(2.0)
    assert mgpo_trajectory_reward(True, False, 0.95, difficulty="band") == pytest.approx(1.0)


def _mgpo_case():
    # G = 2 trajectories, R_traj = [1.75, 0.0]; two "tool" steps each with rewards [1, 0] and [1, 1]
    rewards = torch.tensor([1.75, 0.0])
    gid = torch.tensor([0, 0])
    mask = torch.ones(2, 6)
    token_step = torch.tensor([[-1, 0, 0, 1, 1, -1], [0, 0, 1, 1, -1, -1]])
    return rewards, gid, mask, token_step, [[1.0, 0.0], [1.0, 1.0]], [["tool", "tool"], ["tool", "tool"]]


def test_mgpo_advantage_combination_hand_value():
    from rl.methods.agentic_proposing.mgpo import compute_mgpo_advantages
    rewards, gid, mask, token_step, step_rewards, types = _mgpo_case()
    adv = compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards,
                                  step_types=types, valid=torch.ones(2, dtype=torch.bool), lambda_step=0.5)
    # A_traj = [+0.7071, -0.7071]; step rewards [1,0,1,1] -> A_step = [0.5, -1.5, 0.5, 0.5]
    assert adv[0, 0].item() == pytest.approx(0.707107, abs=1e-5)  # outside any step
    assert adv[0, 1].item() == pytest.approx(0.707107 + 0.25, abs=1e-5)  # step 1
    assert adv[0, 3].item() == pytest.approx(-0.042893, abs=1e-5)  # trajectory 1, step 2: 0.7071 - 0.75
    assert adv[1, 0].item() == pytest.approx(-0.707107 + 0.25, abs=1e-5)


def test_mgpo_steps_normalised_by_type():
    from rl.methods.agentic_proposing.mgpo import compute_mgpo_advantages
    rewards, gid, mask, token_step, step_rewards, _ = _mgpo_case()
    types = [["tool", "think"], ["tool", "think"]]  # pools: tool [1,1] (all equal), think [0,1]
    adv = compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards,
                                  step_types=types, valid=torch.ones(2, dtype=torch.bool), lambda_step=1.0)
    assert adv[0, 1].item() == pytest.approx(0.707107, abs=1e-5)  # tool steps all equal: no step credit
    assert adv[0, 3].item() == pytest.approx(0.707107 - 0.707107, abs=1e-5)  # think: [0,1] -> -0.7071


def test_mgpo_validity_gate_masking_and_reduction():
    from rl.methods.agentic_proposing.mgpo import compute_mgpo_advantages
    rewards, gid, mask, token_step, step_rewards, types = _mgpo_case()
    obs = torch.zeros(2, 6)
    obs[0, 2] = 1  # a tool-output token
    valid = torch.ones(2, dtype=torch.bool)
    adv = compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards,
                                  step_types=types, valid=valid, observation_mask=obs)
    assert adv[0, 2].item() == 0.0
    # invalid first trajectory: its rewards become 0, so the group is all-equal on R_traj
    invalid = compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards,
                                      step_types=types, valid=torch.tensor([False, True]), lambda_step=0.0)
    assert torch.allclose(invalid, torch.zeros(2, 6))
    # lambda_step = 0 is GRPO on the trajectory rewards
    plain = compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards,
                                    step_types=types, valid=valid, lambda_step=0.0)
    assert torch.equal(plain, compute_grpo_advantages(rewards, gid, mask))


def test_mgpo_invalid_trajectory_has_its_step_rewards_zeroed():
    """rl/methods/agentic_proposing/README.md, check 1 with lambda_step != 0: the invalid trajectory's successful steps ([1, 0]) count as 0."""
    from rl.methods.agentic_proposing.mgpo import compute_mgpo_advantages
    rewards, gid, mask, token_step, step_rewards, types = _mgpo_case()
    adv = compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards,
                                  step_types=types, valid=torch.tensor([False, True]), lambda_step=0.5)
    # R_traj -> [0, 0]: A_traj = 0; gated steps [0, 0, 1, 1]: mean 0.5, std 0.57735 -> A_step = [-0.866, -0.866, ..]
    assert adv[0, 1].item() == pytest.approx(-0.5 * 0.866025, abs=1e-5)  # would be +0.25 without the gate
    assert adv[0, 3].item() == pytest.approx(-0.5 * 0.866025, abs=1e-5)
    assert adv[1, 0].item() == pytest.approx(+0.5 * 0.866025, abs=1e-5)
    assert adv[0, 0].item() == 0.0  # outside any step: A_traj only


def test_mgpo_observation_tokens_get_no_gradient():
    """rl/methods/agentic_proposing/README.md, check 4 through the loss: tool-output tokens contribute zero gradient even when a step's
    advantage covers them, and the policy tokens beside them do get one."""
    from rl.methods.agentic_proposing.mgpo import compute_mgpo_advantages
    rewards, gid, mask, token_step, step_rewards, types = _mgpo_case()
    obs = torch.zeros(2, 6)
    obs[0, 2] = obs[1, 1] = 1  # tool outputs inside step 1 of each trajectory
    adv = compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards,
                                  step_types=types, valid=torch.tensor([True, True]), observation_mask=obs)
    logp = torch.full((2, 6), -1.0, requires_grad=True)
    loss, _ = lookup("loss", "ppo_clip")(logp, logp.detach(), adv, mask, eps_low=0.2, eps_high=0.28, agg="token-mean")
    loss.backward()
    assert logp.grad[0, 2] == 0 and logp.grad[1, 1] == 0
    assert logp.grad[0, 1] != 0 and logp.grad[1, 0] != 0


def test_mgpo_refuses_a_batch_without_step_data():
    from rl.methods.agentic_proposing.mgpo import compute_mgpo_advantages
    rewards, gid, mask, token_step, step_rewards, types = _mgpo_case()
    with pytest.raises(ValueError, match=r"\['token_step', 'step_rewards', 'valid'\].*allow_trajectory_only"):
        compute_mgpo_advantages(rewards, gid, mask)
    with pytest.raises(ValueError, match=r"\['valid'\]"):
        compute_mgpo_advantages(rewards, gid, mask, token_step=token_step, step_rewards=step_rewards)
    trajectory_only = compute_mgpo_advantages(rewards, gid, mask, allow_trajectory_only=True)
    assert torch.equal(trajectory_only, compute_grpo_advantages(rewards, gid, mask))


def test_gae_by_hand():
    from rl.advantages import gae_advantages_and_returns
    # gamma 0.9, lam 0.8, rewards [0, 0, 1], values [0.5, 0.4, 0.6]:
    # d2 = 1 - 0.6 = 0.4; d1 = 0.9*0.6 - 0.4 = 0.14; d0 = 0.9*0.4 - 0.5 = -0.14
    # A2 = 0.4; A1 = 0.14 + 0.72*0.4 = 0.428; A0 = -0.14 + 0.72*0.428 = 0.16816; returns = A + V
    adv, ret = gae_advantages_and_returns(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.4, 0.6]]),
                                          torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor([[0.16816, 0.428, 0.4]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.66816, 0.828, 1.0]]), atol=1e-6)


def test_gae_with_gamma_and_lambda_one_is_returns_minus_values_and_skips_masked_tokens():
    from rl.advantages import gae_advantages_and_returns
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    # holes of one and two masked tokens (an odd one tells a carried value from its negation)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1, 0, 0, 1, 0, 0]], dtype=torch.float32)
    adv, ret = gae_advantages_and_returns(r, v, mask, gamma=1.0, lam=1.0)
    to_go = (r * mask).flip(-1).cumsum(-1).flip(-1)  # sum of the counted rewards from t on
    assert torch.allclose(adv, (to_go - v) * mask, atol=1e-5)
    assert torch.allclose(ret, to_go * mask, atol=1e-5)
    # a masked hole (row 1, token 2) is skipped: token 1 bootstraps from token 3, discounted once
    adv_d, _ = gae_advantages_and_returns(r, v, mask, gamma=0.5, lam=0.0)
    assert adv_d[1, 1] == pytest.approx(float(r[1, 1] + 0.5 * v[1, 3] - v[1, 1]), abs=1e-6)
    assert adv_d[1, 4] == pytest.approx(float(r[1, 4] - v[1, 4]), abs=1e-6)  # last counted token: terminal
    # the defaults are gamma 1 and lam 0.95
    assert torch.equal(gae_advantages_and_returns(r, v, mask)[0],
                       gae_advantages_and_returns(r, v, mask, gamma=1.0, lam=0.95)[0])
    assert not torch.allclose(gae_advantages_and_returns(r, v, mask)[0], adv)


def test_gae_estimator_puts_the_outcome_on_the_last_token_and_whitens():
    from rl.advantages import compute_gae_advantages, masked_whiten, outcome_token_rewards
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    tr = outcome_token_rewards(torch.tensor([2.0, -1.0]), mask)
    assert tr.tolist() == [[0, 0, 2.0, 0], [0, 0, 0, -1.0]]
    # a one-token response gets its reward on that token; one whitened value is 0 (its own mean)
    assert outcome_token_rewards(torch.tensor([3.0]), torch.tensor([[1.0, 0.0, 0.0]])).tolist() == [[3.0, 0, 0]]
    assert masked_whiten(torch.tensor([[3.0, 5.0]]), torch.tensor([[1.0, 0.0]])).tolist() == [[0.0, 0.0]]
    values = torch.zeros(2, 4)
    raw = compute_gae_advantages(torch.tensor([2.0, -1.0]), torch.arange(2), mask, values=values, gamma=1.0,
                                 lam=1.0, whiten=False)
    assert raw.tolist() == [[2, 2, 2, 0], [-1, -1, -1, -1]]
    white = compute_gae_advantages(torch.tensor([2.0, -1.0]), torch.arange(2), mask, values=values)
    m = mask.bool()
    assert abs(float(white[m].mean())) < 1e-6 and float(white[m].std()) == pytest.approx(1.0, abs=1e-4)
    assert (white[~m] == 0).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_a_failed_sample_takes_no_part_in_its_groups_statistics(estimator):
    """`reward.failed_samples: exclude`: the group's statistics are those of its scored samples, as if the failed
    one had never been drawn; `train`: its failure_reward counts like a score."""
    from models.tiny import build_tiny_tokenizer
    from rl.sft_data import make_sft_batch
    from rl.step import estimate_advantages
    fn = lookup("advantage", estimator)
    tok = build_tiny_tokenizer()
    batch = make_sft_batch(tok, ["q"] * 4, ["ab", "cd", "ef", "gh"])
    batch.group_id = torch.tensor([0, 0, 0, 0])
    batch.reward_failed = torch.tensor([False, True, False, False])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # row 1 failed: scored failure_reward 0
    excluded = estimate_advantages(batch, rewards, None, fn, {}, "exclude")
    scored_only = batch.select([0, 2, 3])
    alone = fn(rewards[[0, 2, 3]], scored_only.group_id, scored_only.response_mask)
    assert torch.allclose(excluded[[0, 2, 3]], alone) and excluded[1].abs().max() == 0
    trained = estimate_advantages(batch, rewards, None, fn, {}, "train")
    assert torch.allclose(trained, fn(rewards, batch.group_id, batch.response_mask))
    assert not torch.allclose(trained[0], excluded[0])  # the failure's 0 would have shaped the group


def test_distillation_advantages_hand_values():
    """reward_weight * A + coef * (teacher - student) on response tokens; padding stays 0."""
    from rl.advantages import distillation_advantages
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    student = torch.tensor([[-1.0, -2.0, -7.0]])
    teacher = torch.tensor([[-0.5, -3.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = distillation_advantages(adv, student, teacher, mask, coef=2.0, reward_weight=0.5)
    assert torch.allclose(out, torch.tensor([[0.5 + 2 * 0.5, 0.5 + 2 * -1.0, 0.0]]))
    alone = distillation_advantages(adv, student, teacher, mask, coef=1.0, reward_weight=0.0)
    assert torch.allclose(alone, torch.tensor([[0.5, -1.0, 0.0]]))
    same = distillation_advantages(torch.zeros(1, 3), student, student.clone(), mask)
    assert torch.equal(same, torch.zeros(1, 3))  # a teacher equal to the student teaches nothing
