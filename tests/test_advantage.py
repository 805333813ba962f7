import torch

from advantage import grpo_advantage, memory_advantage, token_advantages


def test_grpo_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = grpo_advantage(r, g, eps=0.0)
    # group 0: mean 0.5, population std 0.5 -> +-1; group 1: equal rewards -> 0
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(grpo_advantage(r, g, scale_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]))


def test_grpo_equal_groups_and_singletons_give_exact_zero_never_nan():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.3])  # 0.1 is not dyadic: one-pass float32 variance != 0
    g = torch.tensor([0, 0, 0, 1, 2])
    a = grpo_advantage(r, g)
    assert torch.equal(a, torch.zeros(5))
    assert not a.isnan().any()


def test_grpo_groups_by_recorded_id_not_position():
    r = torch.tensor([1.0, 5.0, 0.0, 5.0])  # interleaved storage: groups 0,1,0,1
    g = torch.tensor([0, 1, 0, 1])
    a = grpo_advantage(r, g, eps=0.0)
    assert torch.allclose(a, torch.tensor([1.0, 0.0, -1.0, 0.0]))


def test_grpo_invalid_rewards_excluded_from_group_stats():
    r = torch.tensor([1.0, 0.0, float('nan'), 1.0])
    valid = torch.tensor([True, True, False, True])
    a = grpo_advantage(r, torch.zeros(4, dtype=torch.long), valid, eps=0.0)
    assert a[2] == 0 and not a.isnan().any()
    # valid rewards 1, 0, 1: mean 2/3, std sqrt(2)/3
    assert torch.allclose(a[[0, 1, 3]], torch.tensor([1 / 3, -2 / 3, 1 / 3]) / (2 ** 0.5 / 3), atol=1e-6)


def test_memory_advantage_pools_all_turns_of_a_group():
    # group 0: two episodes; turn 0 never valid (no memory reward at turn 1)
    mem = torch.tensor([[9.0, 0.2, 0.4], [9.0, 0.6, 0.0], [9.0, 0.5, 0.0]])
    valid = torch.tensor([[False, True, True], [False, True, False], [False, True, False]])
    groups = torch.tensor([0, 0, 1])
    a = memory_advantage(mem, valid, groups, eps=0.0)
    pool = torch.tensor([0.2, 0.4, 0.6])  # mean 0.4, population std sqrt(0.08/3)
    z = (pool - 0.4) / (0.08 / 3) ** 0.5
    assert torch.allclose(a[0, 1:], z[:2], atol=1e-6) and torch.allclose(a[1, 1], z[2], atol=1e-6)
    assert a[:, 0].abs().sum() == 0 and a[1, 2] == 0
    assert a[2].abs().sum() == 0  # group 1 has a single valid turn: no signal
    assert not a.isnan().any()


def test_memory_advantage_only_on_mem_tokens():
    outcome = torch.tensor([0.5])
    action = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1.0]])
    mem_mask = torch.tensor([[0, 1, 0, 0, 0, 1, 1, 0.0]])
    turns = torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 1]])
    mem_adv = torch.tensor([[0.0, 2.0]])  # turn 1 (index 0) has none
    adv = token_advantages(outcome, torch.tensor([0]), action, mem_adv, mem_mask, turns, mem_coef=0.5)
    assert torch.allclose(adv, torch.tensor([[0, 0.5, 0.5, 0.5, 0, 1.5, 1.5, 0.5]]))
    plain = token_advantages(outcome, torch.tensor([0]), action)
    assert torch.allclose(adv - plain, torch.tensor([[0, 0, 0, 0, 0, 1.0, 1.0, 0]]))


# -----------------------------------------------------------------------------
# the memory advantage's options (mem_pool, mem_std), by hand


def test_memory_advantage_pools_by_group_or_by_turn_with_or_without_std():
    r = torch.tensor([[0.0, 1.0, 3.0], [0.0, 2.0, 5.0]])  # two episodes of one group, turns 1-2 scored
    valid = torch.tensor([[False, True, True], [False, True, True]])
    g = torch.tensor([0, 0])
    # MemPO: one pool {1, 3, 2, 5}: mean 2.75, population std sqrt(2.1875)
    want = (torch.tensor([[0.0, 1.0, 3.0], [0.0, 2.0, 5.0]]) - 2.75) / 2.1875 ** 0.5 * valid
    assert torch.allclose(memory_advantage(r, valid, g, eps=0.0), want)
    # per turn index, centred only: turn 1 {1, 2} -> -0.5, 0.5; turn 2 {3, 5} -> -1, 1
    assert memory_advantage(r, valid, g, 0.0, 'turn', False).tolist() == [[0.0, -0.5, -1.0], [0.0, 0.5, 1.0]]
    assert memory_advantage(r, valid, g, 0.0, 'turn', True).tolist() == [[0.0, -1.0, -1.0], [0.0, 1.0, 1.0]]
    # two groups never share a turn pool
    two = memory_advantage(r, valid, torch.tensor([0, 1]), 0.0, 'turn', False)
    assert not two.any()  # each (group, turn) pool holds one value: no signal
