import pytest
import torch

from rl.batch import Batch


def _batch(n=6, p=3, width=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(prompt_ids=torch.randint(1, 50, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.long),
                 response_ids=torch.randint(1, 50, (n, width), generator=g), response_mask=torch.ones(n, width),
                 group_id=torch.arange(n) // 2, rewards=torch.arange(n, dtype=torch.float32),
                 prompts=[f"p{i}" for i in range(n)], responses=[f"r{i}" for i in range(n)])


def test_split_concat_roundtrip():
    b = _batch()
    parts = b.split(4)
    assert [len(x) for x in parts] == [2, 1, 2, 1] or sum(len(x) for x in parts) == 6
    back = Batch.concat(parts)
    assert torch.equal(back.response_ids, b.response_ids)
    assert back.prompts == b.prompts and torch.equal(back.group_id, b.group_id)


def test_concat_repads_left_prompts_and_right_responses():
    a, b = _batch(2, 3, 4), _batch(2, 5, 2, seed=1)
    c = Batch.concat([a, b])
    assert c.prompt_ids.shape == (4, 5) and c.response_ids.shape == (4, 4)
    assert torch.equal(c.prompt_ids[0, 2:], a.prompt_ids[0]) and c.prompt_mask[0, :2].sum() == 0
    assert torch.equal(c.response_ids[2, :2], b.response_ids[0]) and c.response_mask[2, 2:].sum() == 0


def test_select_and_model_inputs_positions():
    b = _batch(2, 3, 2)
    b.prompt_mask[0, 0] = 0  # left padding
    inp = b.model_inputs()
    assert inp["input_ids"].shape == (2, 5)
    assert inp["position_ids"][0].tolist() == [0, 0, 1, 2, 3]
    assert inp["position_ids"][1].tolist() == [0, 1, 2, 3, 4]
    s = b.select([1])
    assert s.prompts == ["p1"] and len(s) == 1


def test_check_groups_fails_loudly():
    b = _batch()
    b.check_groups(2)
    with pytest.raises(ValueError, match="group_id mismatch"):
        b.check_groups(3)
    b.group_id = torch.arange(6)  # every sample its own group while the recipe says n=2
    with pytest.raises(ValueError, match="expected 2 samples per prompt"):
        b.check_groups(2)


def test_pickles():
    import pickle
    b = _batch()
    assert torch.equal(pickle.loads(pickle.dumps(b)).response_ids, b.response_ids)


def test_length_shaping_masks_truncated_and_penalises_long():
    from types import SimpleNamespace

    from rl.step import apply_length_shaping
    b = _batch(3, 2, 4)
    b.response_attn = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    b.truncated = torch.tensor([False, True, False])
    b.rewards = torch.tensor([1.0, 1.0, 1.0])
    apply_length_shaping(b, SimpleNamespace(overlong_buffer=2, overlong_penalty=1.0, mask_truncated=True), 4)
    assert torch.allclose(b.rewards, torch.tensor([1.0, 0.0, 0.5]))
    assert b.response_mask[1].sum() == 0 and b.response_mask[0].sum() == 4


def test_token_step_pads_with_minus_one():
    a, b = _batch(1, 2, 3), _batch(1, 2, 5, seed=1)
    a.token_step = torch.tensor([[0, 0, 1]])
    b.token_step = torch.tensor([[0, 1, 1, 2, 2]])
    c = Batch.concat([a, b])
    assert c.token_step[0].tolist() == [0, 0, 1, -1, -1]


def test_observation_tokens_leave_the_loss():
    from types import SimpleNamespace

    from rl.step import apply_length_shaping
    b = _batch(2, 2, 4)
    b.response_attn = torch.ones(2, 4, dtype=torch.long)
    b.truncated = torch.tensor([False, False])
    b.observation_mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    apply_length_shaping(b, SimpleNamespace(overlong_buffer=0, overlong_penalty=1.0, mask_truncated=False), 4)
    assert b.response_mask.tolist() == [[1, 0, 0, 1], [1, 1, 1, 1]]


def test_extras_follow_select_split_and_concat_with_their_padding_rule():
    a, b = _batch(2, 3, 4), _batch(2, 5, 2, seed=1)
    a.set_extra("w", torch.ones(2, 4), pad="right", pad_value=-1)
    b.set_extra("w", torch.full((2, 2), 2.0), pad="right", pad_value=-1)
    a.set_extra("p", torch.ones(2, 3, dtype=torch.long), pad="left")
    b.set_extra("p", torch.ones(2, 5, dtype=torch.long), pad="left")
    a.set_extra("tag", ["x", "y"])
    b.set_extra("tag", ["z", "w"])
    c = Batch.concat([a, b])
    assert c.extras["w"].value.tolist()[2] == [2.0, 2.0, -1.0, -1.0]  # right-padded with its pad value
    assert c.extras["p"].value.tolist()[0] == [0, 0, 1, 1, 1]  # left-padded like the prompt
    assert c.extras["tag"].value == ["x", "y", "z", "w"]
    parts = c.split(2)
    assert parts[1].extras["tag"].value == ["z", "w"] and parts[1].extras["w"].value.shape == (2, 4)
    assert c.select([3, 0]).extras["tag"].value == ["w", "x"]


def test_extras_are_checked_and_passed_by_name():
    b = _batch(4)
    with pytest.raises(ValueError, match="3 rows for a batch of 4"):
        b.set_extra("w", torch.ones(3, 4))
    with pytest.raises(ValueError, match="core Batch field"):
        b.set_extra("rewards", torch.ones(4))
    with pytest.raises(ValueError, match="token dimension"):
        b.set_extra("w", torch.ones(4), pad="right")
    b.set_extra("w", torch.ones(4))
    b.token_step = torch.zeros(4, 4, dtype=torch.long)

    def estimator(rewards, group_id, response_mask, *, w, token_step, other=None):
        return rewards

    assert set(b.named_fields(estimator)) == {"w", "token_step"}
    b.token_step = None
    with pytest.raises(ValueError, match=r"extras \['w'\] are set in some"):
        Batch.concat([b, _batch(2, seed=1)])


def test_token_budget_plan_by_hand():
    from rl.batch import plan_micro_batches
    # longest first to the lighter rank: r0 gets 10, 5, 3 (18 tokens), r1 gets 8, 7, 2 (17); first-fit in 12
    assert plan_micro_batches([10, 3, 7, 2, 8, 5], 2, 12) == [[[0], [1, 5]], [[3, 4], [2]]]
    # a rank with a single over-long row cannot split it: it gets an empty micro-batch (a filler)
    assert plan_micro_batches([40, 10, 10, 10, 10], 2, 20) == [[[0], []], [[1, 2], [3, 4]]]


def test_token_budget_plan_properties_on_random_lengths():
    from rl.batch import plan_micro_batches
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, ws = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        budget = int(torch.randint(8, 200, (1,), generator=gen))
        costs = torch.randint(1, 120, (n,), generator=gen).tolist()
        plan = plan_micro_batches(costs, ws, budget)
        assert len(plan) == ws and len({len(bins) for bins in plan}) == 1  # same micro-batch count on every rank
        rows = sorted(i for bins in plan for b in bins for i in b)
        assert rows == list(range(n))  # every row exactly once
        for bins in plan:
            for b in bins:
                assert len(b) <= 1 or sum(costs[i] for i in b) <= budget
        loads = [sum(costs[i] for b in bins for i in b) for bins in plan]
        assert max(loads) - min(loads) <= max(costs)  # balanced to within one row


def test_shared_prompt_plan_keeps_a_prompts_rows_together_and_counts_the_prompt_once_by_hand():
    from rl.batch import Batch, plan_prompt_groups
    # prompts A (3 tokens) on rows 0, 2, 4 and B (2 tokens, left-padded) on rows 1, 3; responses of 4, 1, 2, 2, 3
    A, B = [0, 7, 8, 9], [0, 0, 5, 6]
    pm_a, pm_b = [0, 1, 1, 1], [0, 0, 1, 1]
    ids = torch.tensor([A, B, A, B, A])
    mask = torch.tensor([pm_a, pm_b, pm_a, pm_b, pm_a])
    lengths = torch.tensor([4, 1, 2, 2, 3])
    resp = (torch.arange(4)[None] < lengths[:, None]).float()
    batch = Batch(prompt_ids=ids, prompt_mask=mask, response_ids=torch.ones(5, 4, dtype=torch.long),
                  response_mask=resp, group_id=torch.tensor([0, 1, 0, 1, 0]))
    # A costs 3 + 9 = 12 tokens, B 2 + 3 = 5: both fit one micro-batch of 17, not of 16; two ranks get one each
    assert plan_prompt_groups(batch, 1, 17) == [[[0, 1, 2, 3, 4]]]
    assert plan_prompt_groups(batch, 1, 16) == [[[0, 2, 4], [1, 3]]]
    assert plan_prompt_groups(batch, 2, 100) == [[[0, 2, 4]], [[1, 3]]]


def test_micro_batches_of_fills_an_empty_bin_with_a_row_that_carries_no_loss():
    from rl.batch import micro_batches_of
    b = _batch(n=2)
    b.response_attn = b.response_mask.long()
    mbs = micro_batches_of(b, [[[0, 1]], [[]]])
    assert len(mbs[0][0]) == 2 and len(mbs[1][0]) == 1
    assert mbs[1][0].response_mask.sum() == 0 and mbs[1][0].response_attn.sum() > 0  # forward runs, no loss


def test_utilisation_metrics_by_hand():
    from omegaconf import OmegaConf

    from cluster.perf import utilisation
    b = _batch(n=2, p=3, width=3)
    b.response_attn = torch.tensor([[1, 1, 0], [1, 1, 1]])
    cfg = OmegaConf.create({"learner": {"world_size": 1}, "rollout": {"num_workers": 1, "generation_batch_size": 256},
                            "algorithm": {"mini_batches": 1}})
    hardware = {"model": {"matmul_params": 1000.0, "param_bytes": 4000.0},
                "learner": {"matmul_flops": 1e6}, "rollout": {"matmul_flops": 2e6, "copy_bytes_per_s": 1e5}}
    m = utilisation(b, {"train": 0.1, "logprobs": 0.01, "generate": 0.5}, 1.04, hardware, cfg, train_passes=1,
                    logprob_passes=1)
    # tokens 11 (prompts 6, generated 5): learner 6*1000*11 + 2*1000*11 = 88,000 FLOPs in 0.11 s at 1e6
    assert m["perf/mfu"] == pytest.approx(0.8)
    assert m["perf/decode_mfu"] == pytest.approx(2 * 1000 * 11 / (0.5 * 2e6))
    assert m["perf/mbu"] == pytest.approx(4000 * 3 / (0.5 * 1e5))  # 3 decode steps (the longest response)
    assert m["perf/floor_s"] == pytest.approx(0.088 + 0.12) and m["perf/step_over_floor"] == pytest.approx(5.0)
    # an overlapped rollout: the step barely waited for generation, the engines report their own time
    b.metadata = [{"gen_s": 0.3}, {"gen_s": 0.2}]
    hidden = utilisation(b, {"train": 0.1, "logprobs": 0.01, "generate": 0.001}, 1.04, hardware, cfg, train_passes=1,
                         logprob_passes=1)
    assert hidden["perf/mbu"] == pytest.approx(m["perf/mbu"])
    # with the KV cache's reads: prompts of 3, responses of 2 and 3 tokens read 1*3 + 1 = 4 and 2*3 + 3 = 9
    # cached positions, 10 bytes each
    hardware["model"]["kv_bytes_per_token"] = 10.0
    b.metadata = []
    kv = utilisation(b, {"train": 0.1, "logprobs": 0.01, "generate": 0.5}, 1.04, hardware, cfg, train_passes=1,
                     logprob_passes=1)
    assert kv["perf/mbu"] == pytest.approx((4000 * 3 + 10 * 13) / (0.5 * 1e5))


def _ragged(prompt_lens, resp_lens, p=6, width=8):
    """Left-padded prompts and right-padded responses of the given lengths, with every per-token field set."""
    n = len(prompt_lens)
    pm = torch.zeros(n, p, dtype=torch.long)
    rm = torch.zeros(n, width)
    for i, (a, b) in enumerate(zip(prompt_lens, resp_lens)):
        pm[i, p - a:] = 1
        rm[i, :b] = 1
    g = torch.Generator().manual_seed(1)
    b = Batch(prompt_ids=torch.randint(5, 90, (n, p), generator=g) * pm, prompt_mask=pm,
              response_ids=torch.randint(5, 90, (n, width), generator=g) * rm.long(), response_mask=rm,
              response_attn=rm.long(), group_id=torch.arange(n), old_logp=-torch.rand(n, width) * rm,
              advantages=torch.randn(n, width, 3, generator=g), token_step=torch.where(rm.bool(), 0, -1))
    b.set_extra("weight", torch.rand(n, width), pad="right")
    b.set_extra("prompt_flag", pm.float(), pad="left")
    b.set_extra("score", torch.arange(n, dtype=torch.float32))
    return b


def test_a_trimmed_micro_batch_keeps_its_rows_at_its_own_width():
    from rl.batch import micro_batches_of
    b = _ragged([2, 3, 6, 1], [3, 2, 8, 1])
    t = b.select([0, 1, 3]).trimmed()  # the rows with the shorter prompts and responses
    assert t.prompt_ids.shape == (3, 3) and t.response_ids.shape == (3, 3)
    assert t.advantages.shape == (3, 3, 3) and t.extras["weight"].value.shape == (3, 3)
    assert t.extras["prompt_flag"].value.shape == (3, 3) and t.extras["score"].value.tolist() == [0.0, 1.0, 3.0]
    full = b.select([0, 1, 3])
    assert torch.equal(t.old_logp, full.old_logp[:, :3]) and torch.equal(t.prompt_ids, full.prompt_ids[:, 3:])
    # positions of the real tokens are those of the untrimmed rows
    ti, fi = t.model_inputs(), full.model_inputs()
    keep = torch.cat([torch.arange(3, 6), torch.arange(6, 9)])
    assert torch.equal(ti["position_ids"] * ti["attention_mask"], (fi["position_ids"] * fi["attention_mask"])[:, keep])
    assert b.select([2]).trimmed().response_ids.shape == (1, 8)  # a full-width row keeps its width
    assert [m.response_ids.shape[1] for m in micro_batches_of(b, [[[2], [0, 1, 3]]])[0]] == [8, 3]


def test_trimming_changes_no_logprob(tmp_path):
    from transformers import AutoModelForCausalLM

    from models.families import response_logprobs
    from models.tiny import save_tiny
    model = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path, hidden_size=32, num_layers=2, num_heads=2,
                                                           intermediate_size=64)).eval()
    b = _ragged([2, 3, 6, 1], [3, 2, 8, 1]).select([0, 1, 3])
    with torch.no_grad():
        full, _ = response_logprobs(model, b)
        cut, _ = response_logprobs(model, b.trimmed())
    assert cut.shape == (3, 3) and torch.allclose(full[:, :3], cut, atol=1e-5)
    assert torch.all(full[:, 3:] == 0)
