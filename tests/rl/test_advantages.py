import pytest
import torch

from rl.advantages import compute_grpo_advantages, group_stats
from rl.registry import get


def test_grpo_hand_values_unbiased_std():
    # spec §1.7: rewards [1,0,0,1] -> unbiased std 0.57735, advantages ±0.86602
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
    assert get("advantage", "grpo") is compute_grpo_advantages
