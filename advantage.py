"""
Rewards to per-token advantages, MemPO included: GRPO's outcome advantage per group, MemPO's memory
reward (no-grad forwards of the policy on each turn's memory) and memory advantage on <mem> tokens.

Statistics are two-pass in float64: a one-pass float32 variance of equal non-dyadic rewards is a tiny
positive or negative number instead of 0, and dividing by it explodes.
"""

import dataclasses
import time

import torch
import torch.nn.functional as F

from gym import TRUNCATED
from model import autocast, forward_cached, micro_batches, position_ids_from_mask, select_cache, sequence_log_probs

# -----------------------------------------------------------------------------
# advantages


def has_signal(values, valid, group_ids):
    """{group id: bool}: whether a group's valid values differ (two or more of them, not all equal).
    A group without signal gets advantage 0 and adds nothing to the gradient."""
    out = {}
    for g in group_ids.unique().tolist():
        v = values[(group_ids == g) & valid]
        out[g] = v.numel() >= 2 and bool(v.max() != v.min())
    return out


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


def training_rewards(trajs, truncation_penalty=0.0):
    """[N] float32: each episode's reward as the advantages see it: the gym's reward, less
    truncation_penalty where the episode ran out of turns or context (info['stop'] in gym.TRUNCATED),
    so that a loop that hits the budget scores below a wrong answer. DAPO's overlong punishment
    (Yu et al. 2025, §3.4) in a constant form. Logged rewards and success stay the gym's."""
    cut = [t.info.get('stop') in TRUNCATED for t in trajs]
    return torch.tensor([t.reward - truncation_penalty * c for t, c in zip(trajs, cut)], dtype=torch.float32)


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


def memory_advantage(mem_rewards, turn_valid, group_ids, eps=1e-6, pool='group', scale_std=True):
    """MemPO's memory advantage (arXiv 2603.00680, §3): the memory reward normalised over a pool.

    mem_rewards [N, K]: P_mem - P_full of turn k of episode n; turn_valid [N, K] bool: True for turns
    t >= 2 that exist and were scored. pool 'group' (MemPO's): every valid turn of every episode of
    one group (per episode would often see one turn and a zero std); 'turn': the turns of one group
    with the same index k only (ReMemR1, Shi et al. 2026, its trainer's per-(question, turn) baseline):
    a turn-t memory is compared with other turn-t memories, so how far an episode has got, which
    both P's also measure, cancels. scale_std=False: centred only. Returns [N, K] float32, 0 at
    invalid turns and for pools of one value or of equal values."""
    n, k = mem_rewards.shape
    pools = group_ids[:, None].expand(n, k) * (k if pool == 'turn' else 1)
    pools = pools + torch.arange(k)[None, :] if pool == 'turn' else pools
    flat = torch.where(turn_valid, mem_rewards, torch.zeros_like(mem_rewards)).reshape(-1)
    return _group_normalise(flat, turn_valid.reshape(-1), pools.reshape(-1), scale_std, eps).view(n, k)


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


def compute_advantages(model, gym_, cfg, trajs, batch, ref_logp=None):
    """Per-token advantages [R, T-1]: GRPO's outcome advantage per episode, plus MemPO's memory
    advantage on <mem> tokens when mem_coef > 0. ref_logp [R, T-1] (or None) is here for methods that
    put the KL into the reward (REINFORCE++; README, "Swap the loss"). Returns (advantages, stats)."""
    rewards = training_rewards(trajs, cfg['truncation_penalty'])  # [N]: batch['rewards'], less any penalty
    out = grpo_advantage(rewards, batch['group_ids'], batch['valid'], cfg['adv_std'], cfg['adv_eps'])
    # how much outcome signal the step has: 0 when every group's rewards are equal
    signal = has_signal(rewards, batch['valid'], batch['group_ids'])
    stats = dict(outcome_adv_abs_mean=float(out[batch['valid']].abs().mean()) if batch['valid'].any() else 0.0,
                 zero_var_groups=1 - sum(signal.values()) / max(len(signal), 1))
    mem_adv = None
    if cfg['mem_coef']:
        answers = [gym_['answer_text'](t.task) for t in trajs]
        t0 = time.time()
        mem_r, turn_valid = memory_rewards(model, trajs, gym_['fmt'], answers, cfg)
        mem_adv = memory_advantage(mem_r, turn_valid, batch['group_ids'], cfg['adv_eps'], cfg['mem_pool'], cfg['mem_std'])
        n = turn_valid.sum().clamp(min=1)
        stats.update(mem_reward_time_s=time.time() - t0,  # what the memory rewards add to a step
                     mem_reward_mean=float((mem_r * turn_valid).sum() / n),
                     mem_adv_abs_mean=float((mem_adv.abs() * turn_valid).sum() / n))
        for i, t in enumerate(trajs):  # for the logs: report.episode_metrics relates them to memory quality
            t.info['mem_rewards'] = [float(mem_r[i, k]) if turn_valid[i, k] else None for k in range(len(t.turns))]
    adv = token_advantages(out, batch['row_episode'], batch['action_mask'], mem_adv, batch['mem_mask'],
                           batch['turn_ids'], cfg['mem_coef'])
    return adv, stats


def keep_groups_with_signal(trajs, n_groups, truncation_penalty=0.0):
    """Dynamic sampling (Yu et al. 2025, DAPO, §3.2): of the groups rolled out (trajs, whole groups in
    order), keep n_groups, those whose rewards differ first, then all-equal ones to fill the batch,
    so a step never waits for signal that does not come. Kept groups are renumbered 0..n_groups-1.
    Returns (trajectories, the share of all-equal groups among those rolled out)."""
    rewards = training_rewards(trajs, truncation_penalty)  # the rewards the advantages will see
    signal = has_signal(rewards, torch.tensor([t.valid for t in trajs]), torch.tensor([t.group for t in trajs]))
    keep = sorted(signal, key=lambda g: not signal[g])[:n_groups]  # stable: signal first, in rollout order
    new_id = {g: i for i, g in enumerate(sorted(keep))}
    kept = [dataclasses.replace(t, group=new_id[t.group]) for t in trajs if t.group in new_id]
    return kept, 1 - sum(signal.values()) / len(signal)


def tis_weights(trainer_logp, sample_logp, mask, cap):
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"; verl's rollout_is): the sampler and the trainer round differently
    (bf16, other batch shapes), so a token sampled with p_sampler is weighted by
    min(p_trainer / p_sampler, cap). trainer_logp, sample_logp, mask [R, T-1] -> [R, T-1], 1 off the mask."""
    w = torch.exp(trainer_logp - sample_logp).clamp(max=cap)
    return torch.where(mask.bool(), w, torch.ones_like(w))


# -----------------------------------------------------------------------------
# MemPO's memory reward


def answer_pieces(fmt, answer_text, n_scored=None, open_tag='<answer>', close_tag='</answer>'):
    """Ids of a gold answer as the policy writes it, and a 0/1 list marking the scored tokens (never
    the tags). answer_text is e.g. '<answer> a1 ; a2 </answer>'. n_scored: score only the first
    n_scored parts (mem_target 'found'); the parts are then encoded one by one, ' ; ' between them
    (the same ids for the word tokenizer; a BPE may join a part to its separator otherwise)."""
    inner = answer_text.strip()[len(open_tag):-len(close_tag)] if answer_text.strip().startswith(open_tag) else answer_text
    o, c, a = fmt.encode(open_tag), fmt.encode(close_tag), fmt.encode(inner)
    if n_scored is None:
        return o + a + c, [0] * len(o) + [1] * len(a) + [0] * len(c)
    ids, score = list(o), [0] * len(o)
    for i, part in enumerate(inner.split(';')):
        sep, p = (fmt.encode(';') if i else []), fmt.encode(part.strip())
        ids, score = ids + sep + p, score + [0] * len(sep) + [int(i < n_scored)] * len(p)
    return ids + c, score + [0] * len(c)


def scored_turn(turn):
    """True for a turn (an Episode.turns dict) that has a closed memory span, ended with its stop token
    and that the gym's step took as well formed (info['turn_ok']): only such turns get a memory reward."""
    return turn['mem_len'] > 0 and turn['finish'] == 'stop' and turn.get('ok', True)


@torch.no_grad()
def memory_probs(model, trajs, fmt, answers, cfg):
    """(where, P_full [M], P_mem [M]) of the M turns memory_rewards scores: where lists their (episode n,
    turn k); see memory_rewards for the two contexts. For diagnosis (scripts/mem_reward_check.py)
    and for memory_rewards."""
    hists, full, short, where = [t.ids.tolist() for t in trajs], [], [], []
    with_full = cfg.get('mem_baseline', 'full') == 'full'  # 'none': P_mem alone, P_full reported as 0
    for n, t in enumerate(trajs):
        if cfg.get('mem_success_only') and not t.info.get('success'):
            continue  # InfoMem: an answer-likelihood reward is credit only where the episode succeeded
        ans_ids, ans_mask = answer_pieces(fmt, answers[n])
        turn = t.turn.tolist()
        for k in range(1, len(t.turns)):
            mem_len = t.turns[k]['mem_len']
            # a malformed turn already fails its episode; a memory reward on it would rank its span
            # among the real ones (and move its group's normalisation pool)
            if not scored_turn(t.turns[k]):
                continue
            if cfg.get('mem_target') == 'found':  # retention, not progress: only the answers found so far
                n_found = t.info.get('answers_found_turns', [0] * len(t.turns))[k]
                if not n_found:
                    continue
                ans_ids, ans_mask = answer_pieces(fmt, answers[n], n_found)
            start = turn.index(k)  # turn k's forced prefix, then its response
            end = start + len(fmt.turn_prefix) + mem_len  # the history through turn k's </mem>
            if end + len(ans_ids) > cfg['max_len'] and with_full:
                continue
            full.append((n, end, ans_ids, ans_mask))
            short.append((hists[n][:t.prompt_len] + hists[n][start:end], ans_ids, ans_mask))
            where.append((n, k))
    if not where:
        return where, torch.zeros(0), torch.zeros(0)
    p_full = full_answer_probs(model, hists, full, fmt, cfg) if with_full else torch.zeros(len(where))
    return where, p_full, answer_probs(model, short, fmt, cfg)


@torch.no_grad()
def memory_rewards(model, trajs, fmt, answers, cfg):
    """MemPO's memory reward (arXiv 2603.00680, §3) for every turn t >= 2:
    mem_reward_t = P_mem_t - P_full_t, with P = exp(mean log p(gold answer tokens | context)),
      P_full_t: context = the full un-folded history before turn t, then turn t's <mem> span;
      P_mem_t:  context = the prompt, then turn t's <mem> span.
    Both end with the same memory span, so the answer sits where the policy would write it, and the
    difference is what the dropped history still knew that the memory did not carry. No gradient.
    mem_baseline 'none': mem_reward_t = P_mem_t (the pool's mean in memory_advantage is the baseline;
    no full-history pass, no max_len limit). A policy that reads full histories (warmstart_full)
    copies its answer from the memory span that ends both contexts, so P_full follows P_mem and the
    difference can anti-correlate with memory quality (docs/RESULTS.md).
    Every P_full context is a prefix of its episode's history (turn t's <mem> follows its forced
    prefix there), so each history is run once and the answers of all its turns are scored on its
    KV cache (full_answer_probs); the P_mem contexts are short and run as plain rows (answer_probs).
    answers: the gold answer text per trajectory. Returns (mem_rewards [N, K], turn_valid [N, K]);
    turns without a closed memory span, that fail the turn format (scored_turn) or whose full context
    exceeds max_len are not valid: reward 0, outside memory_advantage's statistics."""
    K = max(len(t.turns) for t in trajs)
    mem_r = torch.zeros(len(trajs), K)
    valid = torch.zeros(len(trajs), K, dtype=torch.bool)
    where, p_full, p_mem = memory_probs(model, trajs, fmt, answers, cfg)
    for (n, k), pf, pm in zip(where, p_full.tolist(), p_mem.tolist()):
        mem_r[n, k] = pm - pf
        valid[n, k] = True
    return mem_r, valid


def _mean_answer_prob(logp, score):
    """exp(mean log p) over the scored answer tokens: logp, score [b, S] -> [b]."""
    return torch.exp((logp * score).sum(1) / score.sum(1).clamp(min=1))


def answer_probs(model, seqs, fmt, cfg):
    """P = exp(mean log p(answer tokens | context)) [len(seqs)] for seqs of (context ids, answer ids,
    answer mask: 1 on the tokens scored), in micro-batches of max_tokens_per_microbatch padded tokens."""
    lengths = [len(c) + len(a) for c, a, _ in seqs]
    out = torch.zeros(len(seqs))
    for mb in micro_batches(lengths, cfg['max_tokens_per_microbatch']):
        L = max(lengths[i] for i in mb)
        ids = torch.full((len(mb), L), fmt.pad_id, dtype=torch.long)
        attn = torch.zeros(len(mb), L, dtype=torch.long)
        score = torch.zeros(len(mb), L - 1)
        for row, i in enumerate(mb):
            c, a, am = seqs[i]
            ids[row, :len(c) + len(a)] = torch.tensor(c + a)
            attn[row, :len(c) + len(a)] = 1
            score[row, len(c) - 1:len(c) - 1 + len(a)] = torch.tensor(am, dtype=torch.float32)  # column j scores token j+1
        with autocast(cfg):
            logp = sequence_log_probs(model, ids.to(cfg['device']), attn.to(cfg['device']),
                                      positions=(score > 0).to(cfg['device'])).float().cpu()  # [b, L-1]: answer tokens only
        out[mb] = _mean_answer_prob(logp, score)
    return out


def full_answer_probs(model, hists, items, fmt, cfg):
    """P = exp(mean log p(answer tokens | hists[n][:end])) [len(items)] for items (n, end, answer ids,
    answer mask), the answers after prefixes of a few long histories. A micro-batch of histories runs
    once (right-padded, KV cache); then each item is one row on its history's cache that sees only
    the first end - 1 positions and is fed hists[n][end - 1] and the answer at positions end - 1, end,
    ...: the logits of an answer after hists[n][:end], as a forward of that whole row would give
    them (up to float rounding), at the cost of one history forward instead of one per turn.
    A micro-batch holds at most max_tokens_per_microbatch cached tokens over its item rows."""
    dev, out = cfg['device'], torch.zeros(len(items))
    per_hist = {}
    for i, (n, end, _, _) in enumerate(items):
        per_hist.setdefault(n, []).append(i)
    hist_ids = list(per_hist)
    lengths = [max(items[i][1] for i in per_hist[n]) for n in hist_ids]  # each history through its last scored </mem>
    for mb in micro_batches(lengths, cfg['max_tokens_per_microbatch'], rows=[len(per_hist[n]) for n in hist_ids]):
        L = max(lengths[j] for j in mb)
        ids = torch.full((len(mb), L), fmt.pad_id, dtype=torch.long)
        attn = torch.zeros(len(mb), L, dtype=torch.long)
        for row, j in enumerate(mb):
            ids[row, :lengths[j]] = torch.tensor(hists[hist_ids[j]][:lengths[j]])
            attn[row, :lengths[j]] = 1
        rows = [(row, i) for row, j in enumerate(mb) for i in per_hist[hist_ids[j]]]
        S = max(len(items[i][2]) for _, i in rows) + 1
        seg = torch.full((len(rows), S), fmt.pad_id, dtype=torch.long)
        seg_attn = torch.zeros(len(rows), L + S, dtype=torch.long)
        pos = torch.zeros(len(rows), S, dtype=torch.long)
        score = torch.zeros(len(rows), S)
        for r, (row, i) in enumerate(rows):
            n, end, a, am = items[i]
            seg[r, :len(a) + 1] = torch.tensor(hists[n][end - 1:end] + a)
            seg_attn[r, :end - 1] = 1  # the history before its last memory token, which the row feeds again
            seg_attn[r, L:L + len(a) + 1] = 1
            pos[r, :len(a) + 1] = torch.arange(end - 1, end + len(a))
            score[r, :len(a)] = torch.tensor(am, dtype=torch.float32)  # position j scores segment token j+1
        with autocast(cfg):
            _, cache = forward_cached(model, ids.to(dev), attn.to(dev), position_ids_from_mask(attn).to(dev))
            cache = select_cache(cache, torch.tensor([row for row, _ in rows], device=dev))
            logits, _ = forward_cached(model, seg.to(dev), seg_attn.to(dev), pos.to(dev), cache, every_position=True)
        logp = F.log_softmax(logits.float(), -1)[:, :-1].gather(-1, seg[:, 1:, None].to(dev)).squeeze(-1).cpu()  # [rows, S-1]
        out[[i for _, i in rows]] = _mean_answer_prob(logp, score[:, :-1])
    return out
