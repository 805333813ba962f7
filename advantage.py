"""
Pure tensor maths from rewards to per-token advantages: GRPO's outcome advantage and MemPO's memory
advantage. No model, no text.

Statistics are two-pass in float64: a one-pass float32 variance of equal non-dyadic rewards is a tiny
positive or negative number instead of 0, and dividing by it explodes.
"""

import torch


def _group_normalise(values, valid, group_ids, scale_std, eps):
    """(v - mean) / (std + eps) over the valid entries of each group; 0 where a group's valid entries
    are all equal (no signal) or number fewer than two, and 0 at invalid entries. values [N] -> [N]."""
    out = torch.zeros_like(values, dtype=torch.float64)
    for g in group_ids.unique():
        sel = (group_ids == g) & valid
        v = values[sel].double()
        if v.numel() < 2 or v.max() == v.min():
            continue  # a group of one, or of equal rewards, carries no learning signal
        centred = v - v.mean()
        out[sel] = centred / (centred.pow(2).mean().sqrt() + eps) if scale_std else centred
    return out.float()


def grpo_advantage(rewards, group_ids, valid=None, scale_std=True, eps=1e-6):
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath §4.1.2): (r - mean_g) / (std_g + eps).

    rewards [N] float, group_ids [N] long (the recorded group id, never the storage position),
    valid [N] bool (False for episodes whose reward was NaN/inf or whose env raised: they get 0 and
    do not enter their group's statistics). std is the population std of the group; scale_std=False
    gives Dr.GRPO's unscaled r - mean. Groups of one or of equal rewards give exactly 0.
    Returns [N] float32."""
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))  # NaN never reaches the maths
    return _group_normalise(rewards, valid, group_ids, scale_std, eps)


def memory_advantage(mem_rewards, turn_valid, group_ids, eps=1e-6):
    """MemPO's memory advantage (arXiv 2603.00680, §3).

    mem_rewards [N, K]: P_mem - P_full of turn k of episode n; turn_valid [N, K] bool: True for turns
    t >= 2 that exist (turn 1 has no earlier history, so no memory reward). The statistics pool every
    valid turn of every episode of one group (normalising per episode would often see one turn and a
    zero std). Returns [N, K] float32, 0 at invalid turns, for pools of one value or of equal values."""
    n, k = mem_rewards.shape
    flat_groups = group_ids[:, None].expand(n, k).reshape(-1)
    flat = torch.where(turn_valid, mem_rewards, torch.zeros_like(mem_rewards)).reshape(-1)
    return _group_normalise(flat, turn_valid.reshape(-1), flat_groups, True, eps).view(n, k)


def token_advantages(outcome_adv, row_episode, action_mask, mem_adv=None, mem_mask=None, turn_ids=None,
                     mem_coef=0.0):
    """Per-token advantages of the training rows: [R, T-1].

    outcome_adv [N] per episode; row_episode [R] the episode of each row (an episode is one row, or
    one row per turn when its context was folded); action_mask [R, T-1]. Every policy token gets its
    episode's outcome advantage. With mem_coef != 0, the policy tokens of each turn's memory span
    (mem_mask [R, T-1]: the sampled tokens through </mem>; the forced <mem> is not a policy token)
    also get mem_coef * mem_adv[n, turn] (mem_adv [N, K], turn_ids [R, T-1], -1 outside turns)."""
    adv = outcome_adv[row_episode][:, None] * action_mask  # [R, T-1]
    if mem_coef and mem_adv is not None:
        turn = turn_ids.clamp(min=0)
        per_token = mem_adv[row_episode[:, None].expand_as(turn), turn]  # [R, T-1]
        adv = adv + mem_coef * per_token * mem_mask * action_mask
    return adv
