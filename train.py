"""
Train a language-model agent with multi-turn RL: rollout -> rewards -> advantages -> PPO.

    python train.py config/tiny.yaml --steps=50 --seed=2

One training step, top to bottom (see main() and train_step()):
 1. draw batch_size tasks, repeat each group_size times (one group id per task)
 2. rollout: batched, token-in/token-out, KV cache (rollout.py)
 3. reference log-probs from the frozen starting policy (when kl_coef > 0)
 4. advantages: GRPO per group + MemPO's memory advantage on <mem> tokens (advantage.py)
 5. PPO: ppo_epochs over shuffled mini-batches; policy_loss() per micro-batch, exact normalisation
 6. log one JSON line, evaluate every eval_every steps, checkpoint every save_every steps

Simplifications, on purpose:
1. No value model: GRPO's group baseline replaces it (no GAE, no bootstrapping at truncation;
   truncated episodes get reward 0 and are counted in truncation_rate).
2. The old log-probs are the sampler's own (exact in float32, checked every step as logp_gap_max on
   the first mini-batch, before any update), so no separate old-policy forward pass runs.
3. The warm start is plain cross-entropy on the policy tokens of scripted episodes.
"""

import copy
import glob
import json
import math
import os
import random
import sys
import time

import torch

import report
from advantage import grpo_advantage, memory_advantage, token_advantages
from config import all_reduce, config, fail, gather, init_distributed, load_config, rank, sync_gradients, world_size  # noqa: F401
from gym import GymContractError, OutOfVocabulary, gym_module, load_gym
from model import (autocast, count_params, fold_lora, load_policy, lora_layers, merged, micro_batches, reference_log_probs,
                   sequence_log_probs)
from rollout import check_prompts_fit, collate, episode_rows, memory_rewards, run_tasks

# -----------------------------------------------------------------------------
# the loss: one short function a forker replaces (README, "Swap the loss")

LOG_RATIO_MAX = 20.0  # exp(20) = 4.9e8 is finite in float32; beyond the clamp a token has no gradient
KL_MAX = 10.0         # bound on a token's KL estimate; its gradient is 0 beyond it (verl bounds it too)


def kl_penalty(logp, ref_logp, kl_type):
    """Per-token KL estimate [b, L-1] of the policy from the reference (Schulman 2020, "Approximating
    KL divergence"): k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1, log r = logp - ref.

    The log-ratio is clamped to +-LOG_RATIO_MAX so exp cannot overflow, and the estimate to
    [-KL_MAX, KL_MAX], where its gradient is 0: no token's gradient d(kl)/d(logp) exceeds 12.6 in
    magnitude (k3's slope where it reaches 10, at log r = -2.6; k2: 4.5; k1: 1), times kl_coef.
    k1 used as a loss has zero gradient in expectation (E[d log p] = 0 under the policy): it only
    works as a penalty in the reward, as REINFORCE++ uses it; as a loss use k2 or k3."""
    log_ratio = (logp - ref_logp).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    if kl_type == 'k1':
        kl = log_ratio
    elif kl_type == 'k2':
        kl = 0.5 * log_ratio ** 2
    else:
        kl = torch.exp(-log_ratio) + log_ratio - 1
    return kl.clamp(-KL_MAX, KL_MAX)


def policy_loss(logp, old_logp, advantages, mask, weights, cfg, ref_logp=None):
    """The loss of one micro-batch: PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with
    asymmetric clipping, clip-higher (Yu et al. 2025, DAPO, §3.1), plus kl_coef x kl_penalty.

    logp [b, L-1] current log-probs (with gradient); old_logp [b, L-1] the sampler's; advantages
    [b, L-1]; mask [b, L-1] 1 on trained policy tokens; weights [b, L-1] loss_weights() (0 off the
    mask); ref_logp [b, L-1] or None. The log-ratio is clamped to +-LOG_RATIO_MAX before exp: one bad
    stored log-prob gives a finite loss and no gradient instead of inf and a lost mini-batch.
    Returns (loss: scalar, sum of weights x per-token loss; stats: dict of [b, L-1] tensors ratio,
    clipped (bool, the surrogate's gradient is 0 there), clamped (bool), kl or None)."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX))
    clipped_ratio = ratio.clamp(1 - cfg['clip_low'], 1 + cfg['clip_high'])
    loss_tok = -torch.min(ratio * advantages, clipped_ratio * advantages)
    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, cfg['kl_type'])
        loss_tok = loss_tok + cfg['kl_coef'] * kl
    with torch.no_grad():
        clipped = ((ratio < 1 - cfg['clip_low']) & (advantages < 0)) | ((ratio > 1 + cfg['clip_high']) & (advantages > 0))
        clamped = log_ratio.detach().abs() > LOG_RATIO_MAX
    return (loss_tok * weights).sum(), dict(ratio=ratio.detach(), clipped=clipped, clamped=clamped, kl=kl)


def loss_weights(mask, row_episode, loss_agg, max_episode_tokens, n_tokens=None, n_episodes=None):
    """Per-token weights [R, T-1] whose weighted sum is the mini-batch loss, computed once per
    mini-batch before it is split into micro-batches, so the gradient cannot depend on the split.

    mask [R, T-1]: 1 on trained tokens (invalid episodes already 0); row_episode [R]: each row's
    episode. Only trained tokens, and episodes with at least one, are counted by every rule:
      token-mean  1 / n_tokens
      seq-mean    1 / (the token's episode's tokens x n_episodes)
      drgrpo      1 / (max_episode_tokens x n_episodes), Dr.GRPO's constant normaliser (Liu et al.
                  2025, "Understanding R1-Zero-Like Training", §3.1)
    n_tokens, n_episodes: the totals over all ranks (default: counted here). An empty mini-batch
    gets weights 0, never a division by 0."""
    per_ep = torch.zeros(int(row_episode.max()) + 1 if len(row_episode) else 0).index_add_(0, row_episode, mask.sum(1))
    n_tokens = float(mask.sum()) if n_tokens is None else n_tokens
    n_episodes = float((per_ep > 0).sum()) if n_episodes is None else n_episodes
    if loss_agg == 'token-mean':
        return mask / max(n_tokens, 1.0)
    if loss_agg == 'seq-mean':
        return mask / (per_ep[row_episode].clamp(min=1)[:, None] * max(n_episodes, 1.0))
    return mask / (max_episode_tokens * max(n_episodes, 1.0))


# -----------------------------------------------------------------------------
# the pieces of one step


def compute_advantages(model, gym_, cfg, trajs, batch, ref_logp=None):
    """Per-token advantages [R, T-1]: GRPO's outcome advantage per episode, plus MemPO's memory
    advantage on <mem> tokens when mem_coef > 0. ref_logp [R, T-1] (or None) is here for methods that
    put the KL into the reward (REINFORCE++; README, "Swap the loss"). Returns (advantages, stats)."""
    out = grpo_advantage(batch['rewards'], batch['group_ids'], batch['valid'], cfg['adv_std'], cfg['adv_eps'])
    # how much outcome signal the step has: 0 when every group's rewards are equal
    stats = dict(outcome_adv_abs_mean=float(out[batch['valid']].abs().mean()) if batch['valid'].any() else 0.0)
    mem_adv = None
    if cfg['mem_coef']:
        answers = [gym_['answer_text'](t.task) for t in trajs]
        t0 = time.time()
        mem_r, turn_valid = memory_rewards(model, trajs, gym_['fmt'], answers, cfg)
        mem_adv = memory_advantage(mem_r, turn_valid, batch['group_ids'], cfg['adv_eps'])
        n = turn_valid.sum().clamp(min=1)
        stats.update(mem_reward_time_s=time.time() - t0,  # issue #16: what the memory rewards add to a step
                     mem_reward_mean=float((mem_r * turn_valid).sum() / n),
                     mem_adv_abs_mean=float((mem_adv.abs() * turn_valid).sum() / n),
                     **reward_quality_corr(mem_r, turn_valid, trajs))
    adv = token_advantages(out, batch['row_episode'], batch['action_mask'], mem_adv, batch['mem_mask'],
                           batch['turn_ids'], cfg['mem_coef'])
    return adv, stats


def reward_quality_corr(mem_r, turn_valid, trajs):
    """{'mem_reward_quality_corr': Pearson correlation over the valid turns between the memory reward
    (mem_r [N, K]) and the memory quality the gym logs per turn (info['mem_quality_turns'], the memory
    gym's), or {} when fewer than 3 turns have both or either side is constant. Does the memory
    reward pay for memories that keep what later turns need (issue #16)? The turns of every rank are
    gathered first, so all ranks return the same keys and value."""
    pairs = gather([(float(mem_r[n, k]), q) for n, t in enumerate(trajs)
                    for k, q in enumerate(t.info.get('mem_quality_turns', ())) if q is not None and turn_valid[n, k]])
    if len(pairs) < 3:
        return {}
    r, q = torch.tensor(pairs, dtype=torch.float64).T
    r, q = r - r.mean(), q - q.mean()
    denom = float(r.norm() * q.norm())
    return {'mem_reward_quality_corr': float(r @ q) / denom} if denom > 0 else {}


def update_mode(model):
    """Dropout off for the update's forward passes (eval mode; gradients still flow): PPO's ratio
    compares their log-probs with the sampler's, taken in eval mode, and dropout would make them
    differ before any step (log-prob gaps of 0.1 to 0.25 at attention dropout 0.3). Hugging Face checkpoints a
    layer only in training mode, so a checkpointing layer keeps training=True, not its children."""
    model.eval()
    for m in model.modules():
        if getattr(m, 'gradient_checkpointing', False):
            m.training = True


def is_reference(model, ref_model):
    """True when the policy's weights are the KL reference's (as at the first RL step), so its KL
    term is 0. LoRA's reference is the base weights: the policy is it while every lora_B is 0."""
    if ref_model is model:
        return all(not p.any() for n, p in model.named_parameters() if 'lora_B' in n)
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def ppo_update(model, opt, batch, adv, ref_logp, cfg, rng, episode_ids=None, n_global=None, at_reference=False):
    """ppo_epochs passes over shuffled mini-batches of episodes; one optimizer step per mini-batch,
    policy_loss() on each micro-batch. batch: collate() of this process's episodes; adv, ref_logp
    [R, T-1] (ref_logp may be None). at_reference: the policy's weights are the reference's
    (is_reference()). Returns a dict of metrics.

    A mini-batch with no signal takes no optimizer step: no trained token carries advantage and the
    KL term is 0 (no reference, or k2 / k3 while the policy is still the reference). Its true gradient
    is 0; the computed one is rounding (~1e-9: the reference's log-probs come from other batch shapes),
    which Adam would turn into a full step. The forward passes run with dropout off (update_mode()).

    Data parallel (torchrun): each rank holds whole groups; episode_ids [N] are their indices in the
    global batch of n_global episodes. Every rank shuffles the global indices with the same rng, so
    all ranks agree on each mini-batch; loss normalisers are global and gradients are summed across
    ranks, so N ranks compute exactly the update of one process on the global batch. A micro-batch,
    or a rank's share, without trained tokens (invalid episodes) adds loss 0 and gradient 0. A
    non-finite loss or gradient skips that optimizer step (counted in bad_steps); when every step was
    skipped, loss and grad_norm are None."""
    dev = cfg['device']
    episode_ids = torch.arange(len(batch['rewards'])) if episode_ids is None else episode_ids
    n_global = n_global or len(batch['rewards'])
    mask = batch['action_mask'] * batch['valid'][batch['row_episode']][:, None]  # [R, T-1]; invalid episodes weigh 0
    row_global = episode_ids[batch['row_episode']]  # [R]
    lengths = batch['attention_mask'].sum(1).tolist()
    max_ep_tokens = cfg['max_turns'] * cfg['max_response_tokens']
    sums = dict(clip_frac=0.0, kl=0.0, entropy=0.0, tokens=0.0, loss=0.0, log_ratio_clamped=0.0)
    m = dict(grad_norm=0.0, logp_gap_max=0.0, ratio_dev_first_minibatch=0.0, bad_steps=0)
    first, n_steps = True, cfg['ppo_epochs'] * cfg['mini_batches']
    no_kl = ref_logp is None or not cfg['kl_coef']
    kl_free = no_kl or (at_reference and cfg['kl_type'] != 'k1')  # at the reference k2, k3 have gradient 0; k1 not
    update_mode(model)
    for epoch in range(cfg['ppo_epochs']):
        order = list(range(n_global))
        rng.shuffle(order)
        for mb_eps in [order[i::cfg['mini_batches']] for i in range(cfg['mini_batches'])]:
            rows = torch.nonzero(torch.isin(row_global, torch.tensor(mb_eps))).squeeze(1)
            signal = not kl_free or all_reduce(float(((adv[rows] != 0) & mask[rows].bool()).sum())) > 0
            per_ep = torch.zeros(n_global).index_add_(0, row_global[rows], mask[rows].sum(1))
            w = loss_weights(mask[rows], row_global[rows], cfg['loss_agg'], max_ep_tokens,
                             n_tokens=all_reduce(float(per_ep.sum())), n_episodes=all_reduce(float((per_ep > 0).sum())))
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for mb in micro_batches([lengths[i] for i in rows.tolist()], cfg['max_tokens_per_microbatch']):
                r = rows[mb]
                L = max(lengths[i] for i in r.tolist())
                if not mask[r, :L - 1].any():  # checked on the CPU copy: no device sync per micro-batch
                    continue  # nothing to train here (invalid episodes): loss 0, gradient 0
                am = mask[r, :L - 1].to(dev)
                ids, attn = batch['ids'][r, :L].to(dev), batch['attention_mask'][r, :L].to(dev)
                with autocast(cfg):
                    logp, ent = sequence_log_probs(model, ids, attn, cfg['temperature'], with_entropy=True, positions=am)
                old = batch['sample_logp'][r, :L - 1].to(dev)
                ref = ref_logp[r, :L - 1].to(dev) if ref_logp is not None else None
                loss, st = policy_loss(logp, old, adv[r, :L - 1].to(dev), am, w[mb, :L - 1].to(dev), cfg, ref)
                if signal:  # else the loss is only logged
                    loss.backward()
                total += loss.item()
                with torch.no_grad():
                    pol = am.bool()
                    sums['clip_frac'] += float((st['clipped'] & pol).sum())
                    sums['log_ratio_clamped'] += float((st['clamped'] & pol).sum())
                    sums['kl'] += float((st['kl'].detach() * am).sum()) if st['kl'] is not None else 0.0
                    sums['entropy'] += float((ent * am).sum())
                    sums['tokens'] += float(am.sum())
                    if first:  # before any optimizer step: the sampler's log-probs must match
                        m['logp_gap_max'] = max(m['logp_gap_max'], float((logp - old).abs()[pol].max()))
                        m['ratio_dev_first_minibatch'] = max(m['ratio_dev_first_minibatch'],
                                                             float((st['ratio'] - 1).abs()[pol].max()))
            first = False
            total = all_reduce(total)
            if not signal:  # the true gradient is 0 (docstring): no step, not even AdamW's weight decay
                sums['loss'] += total / n_steps
                continue
            sync_gradients(model)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip']))
            if not (math.isfinite(total) and math.isfinite(grad_norm)):
                m['bad_steps'] += 1  # a non-finite loss never reaches the weights
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            kl_free = no_kl  # the policy has left the reference
            sums['loss'] += total / n_steps
            m['grad_norm'] = max(m['grad_norm'], grad_norm)
    sums = {k: all_reduce(v) for k, v in sums.items()}
    m['loss'] = sums['loss'] / world_size()
    for k in ('clip_frac', 'kl', 'entropy'):  # means over the policy tokens of all updates
        m[k] = sums[k] / max(sums['tokens'], 1.0)
    m['log_ratio_clamped'] = sums['log_ratio_clamped']  # tokens whose log-ratio hit +-LOG_RATIO_MAX
    m['logp_gap_max'] = all_reduce(m['logp_gap_max'], 'max')
    m['ratio_dev_first_minibatch'] = all_reduce(m['ratio_dev_first_minibatch'], 'max')
    if ref_logp is None:
        m['kl'] = None
    if m['bad_steps'] == n_steps:  # every step skipped: no loss, not a loss of 0
        m['loss'] = m['grad_norm'] = None
    return m


_WARNED = set()
_INVALID_FATE = {'RL': ', left out of the update, logged as invalid_episodes', 'warm start': ', not imitated'}


def check_invalid(trajs, what):
    """Invalid episodes (the gym's step raised, or its reward was not a finite number) get reward 0 and
    are left out of the RL update and of the warm start; the first time, one stderr line says how many
    and why. When every episode of `what` on every rank is invalid the gym is broken, not flaky: exit 2
    with an error. Every rank calls it (the counts are summed over ranks)."""
    bad = [t.info.get('error', 'invalid') for t in trajs if not t.valid]
    n_bad, n = all_reduce(float(len(bad))), all_reduce(float(len(trajs)))
    if n_bad and n_bad == n:
        fail(f"{what}: every episode is invalid; the first: {bad[0]}")
    if n_bad and what not in _WARNED and rank() == 0:
        _WARNED.add(what)
        print(f"warning: {what}: {n_bad:.0f} of {n:.0f} episodes invalid (reward 0{_INVALID_FATE.get(what, '')})"
              + (f"; the first: {bad[0]}" if bad else ''), file=sys.stderr)


def train_step(model, ref_model, opt, gym_, cfg, rng, gen):
    """One RL step on this rank's share of the groups (steps 1-5 of the docstring). Returns (metrics
    dict, trajectories, batch, advantages)."""
    tasks = [rng.choice(gym_['train_tasks']) for _ in range(cfg['batch_size'])]  # the same draw on every rank
    mine = list(range(rank(), cfg['batch_size'], world_size()))  # a group never straddles ranks
    trajs = run_tasks(model, gym_, cfg, [tasks[g] for g in mine], cfg['group_size'], mine, gen)
    check_invalid(trajs, 'RL')
    batch = collate(trajs, gym_['fmt'].pad_id)
    ref_logp = reference_log_probs(ref_model, batch, cfg) if ref_model is not None else None
    adv, mem_stats = compute_advantages(model, gym_, cfg, trajs, batch, ref_logp)
    if not torch.isfinite(adv).all():
        raise FloatingPointError('non-finite advantages')
    episode_ids = torch.tensor([t.group * cfg['group_size'] + i % cfg['group_size'] for i, t in enumerate(trajs)])
    m = ppo_update(model, opt, batch, adv, ref_logp, cfg, rng, episode_ids, cfg['batch_size'] * cfg['group_size'],
                   ref_model is not None and is_reference(model, ref_model))
    eps = gather([report.summarise(t) for t in trajs])
    log = dict(**report.episode_metrics(eps), invalid_episodes=sum(not e['valid'] for e in eps),
               tokens=sum(e.get('tt', 0) for e in eps),
               turns_mean=sum(e.get('n_turns', 0) for e in eps) / len(eps),
               mem_tokens_mean=all_reduce(float(batch['mem_mask'].sum())) / len(eps),
               **{k: all_reduce(v) / world_size() for k, v in mem_stats.items()}, **m)
    return log, trajs, batch, adv


# -----------------------------------------------------------------------------
# evaluation and warm start


EVAL_EPISODES_PER_BATCH = 512  # an evaluation rolls out at most this many episodes at once


@torch.no_grad()
def evaluate(model, gym_, cfg, step):
    """Held-out success, greedy (one episode per task) and sampled (eval_samples per task); the tasks
    are sharded over ranks and the episode summaries gathered. Sampling uses its own generator, seeded
    by the step, so evaluating never shifts the training run's random streams. A gym with a validation
    split (the optional gym_['val_tasks']) gets the same on it (eval_val_success sampled,
    eval_val_greedy_success, eval_val_em_k2, ...), after held-out and from a generator of its own (another seed), so that
    every held-out number is the one a gym without it logs. Recipes are chosen on validation, never
    on held-out."""
    splits = [(gym_['eval_tasks'], 0, 'eval_greedy_success', 'eval_sampled_success', 'eval_')]
    if gym_.get('val_tasks'):
        splits.append((gym_['val_tasks'], 1 << 32, 'eval_val_greedy_success', 'eval_val_success', 'eval_val_'))
    out = {}
    for split, seed_offset, greedy_key, sampled_key, prefix in splits:
        tasks = split[rank()::world_size()]
        gen = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'] * 7919 + step * 104729 + rank() + seed_offset)
        for key, temp, reps in [(greedy_key, 0.0, 1), (sampled_key, cfg['temperature'], cfg['eval_samples'])]:
            per_batch = max(1, EVAL_EPISODES_PER_BATCH // reps)  # bounded memory however many tasks are asked for
            trajs = [t for i in range(0, len(tasks), per_batch)
                     for t in run_tasks(model, gym_, cfg, tasks[i:i + per_batch], reps, generator=gen, temperature=temp)]
            check_invalid(trajs, f"evaluation ({'greedy' if temp == 0 else 'sampled'})")
            eps = gather([report.summarise(t) for t in trajs])
            out[key] = report.episode_metrics(eps)['success_rate']
            if key == sampled_key:
                out.update(report.episode_metrics(eps, prefix))
    return dict(out, **{f'eval_baseline_{k}': v for k, v in gym_['baselines'].items()})


def warm_start_loss(model, batch, idx, cfg):
    """Mean negative log-likelihood (nats per policy token) of the policy tokens of rows idx
    (LongTensor [n]) of a collated batch; template, prompt and tool tokens have weight 0. Every
    position is projected (projecting only policy tokens is cheaper but moved the main job's greedy
    step-0 success from 0.271 to 0.250 by float rounding)."""
    L = int(batch['attention_mask'][idx].sum(1).max())
    am = batch['action_mask'][idx, :L - 1].to(cfg['device'])
    with autocast(cfg):
        logp = sequence_log_probs(model, batch['ids'][idx, :L].to(cfg['device']),
                                  batch['attention_mask'][idx, :L].to(cfg['device']))
    return -(logp * am).sum() / am.sum().clamp(min=1)


def warm_start(model, gym_, cfg, rng):
    """Cross-entropy on the policy tokens of scripted episodes (tool and template tokens excluded),
    rolled out by the same code as RL. Each step draws warmstart_batch_size episodes with all their
    rows, so folded and full-history agents imitate the same number of turns per step. Returns the
    mean loss of the last 10 steps (nats per policy token), or None when there is no warm start."""
    n = cfg['warmstart_episodes']
    if n == 0 or cfg['warmstart_steps'] == 0 or gym_['warm_policy'] is None:
        return None
    tasks = [rng.choice(gym_['train_tasks']) for _ in range(n)]
    policies = [gym_['warm_policy'](rng) for _ in range(n)]
    trajs = run_tasks(policies, gym_, cfg, tasks)
    check_invalid(trajs, 'warm start')
    cut = sum(u['finish'] == 'length' and u['train'] for t in trajs for u in t.turns)
    if cut and rank() == 0:  # the policy would learn a turn that never ends
        print(f"warning: warm start: {cut} of {sum(len(t.turns) for t in trajs)} scripted turns are cut at "
              f"max_response_tokens={cfg['max_response_tokens']}; raise it so the warm start imitates whole turns",
              file=sys.stderr)
    trajs = [t for t in trajs if t.valid]  # as in RL, an invalid episode (the env raised) is not trained on
    n = len(trajs)
    batch = collate(trajs, gym_['fmt'].pad_id)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['warmstart_lr'], weight_decay=0.0)
    model.train()
    rows_of = episode_rows(batch['row_episode'], n)  # a step draws episodes, not rows (docstring)
    losses = []
    for it in report.progress(range(cfg['warmstart_steps']), 'warm start', cfg, lambda: f'loss {losses[-1]:.3f}',
                              show=rank() == 0):
        # 30-step ramp (a fifth of a warm start shorter than 40 steps), then cosine decay to 10%: the
        # scripted targets are deterministic, and at a constant lr the loss stays noisy (memory gym:
        # 0.17 vs 0.08; step-0 EM at k=2 0.32 vs 0.69)
        frac, ramp = it / cfg['warmstart_steps'], 30 if cfg['warmstart_steps'] >= 40 else max(1, cfg['warmstart_steps'] // 5)
        for g in opt.param_groups:
            g['lr'] = cfg['warmstart_lr'] * min(1.0, (it + 1) / ramp) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        idx = torch.tensor([r for _ in range(cfg['warmstart_batch_size']) for r in rows_of[rng.randrange(n)]])
        loss = warm_start_loss(model, batch, idx, cfg)
        losses.append(loss.item())
        if not batch['action_mask'][idx].any():  # only scripted mistakes drawn: nothing to imitate, and
            continue  # Adam's momentum would still move the weights
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        opt.step()
    return sum(losses[-10:]) / len(losses[-10:])


# -----------------------------------------------------------------------------
# start or resume


def reference_of(model):
    """The frozen KL reference: a copy of the policy, or with LoRA the policy itself, which
    reference_log_probs runs with its adapters off (the base weights; no second copy)."""
    return model if lora_layers(model) else copy.deepcopy(model).eval()


def save(cfg, step, model, opt, ref_model, gym_, rng, gen):
    """Write out_dir/ckpt_<step>.pt: weights, optimizer, the KL reference (unless it is the policy
    itself: none, or LoRA's base), every random stream (the sampling generators of all ranks), the
    config and the tiny model's vocabulary; keeps the newest keep_checkpoints. Every rank calls it."""
    gens = gather([gen.get_state()])
    if rank() == 0:
        report.save_checkpoint(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step, config=cfg,
                                    rng=dict(python=rng.getstate(), torch=torch.get_rng_state(), gen=gens),
                                    ref_model=ref_model.state_dict() if ref_model not in (None, model) else None,
                                    vocab=getattr(gym_['tok'], 'itos', None)),  # the tiny model's words
                               cfg['out_dir'], step, cfg['keep_checkpoints'])


def check_out_dir(cfg, state):
    """Stop (exit 2, one line) before a fresh run would replace an earlier run in out_dir without
    overwrite=True, or when --resume finds another run's checkpoint (other gym, model, seed or tasks)
    or a checkpoint past `steps`. state: the loaded checkpoint or None (all-corrupt checkpoints stop
    in report.load_latest_checkpoint). Runs before the gym's set-up, so a refusal costs no time."""
    old = glob.glob(os.path.join(cfg['out_dir'], report.CHECKPOINTS))
    metrics = os.path.exists(os.path.join(cfg['out_dir'], 'metrics.jsonl'))
    keys = ('gym', 'model', 'seed', 'eval_tasks', 'val_tasks', 'lora_rank')  # other weights or tasks: another run
    keys += report.MODEL_SHAPE if cfg['model'] == 'tiny' else ()  # the tiny model's shape
    differ = [k for k in keys if state is not None and state['config'].get(k, cfg[k]) != cfg[k]]
    if differ:
        fail(f"--resume=True: {cfg['out_dir']} was trained with "
             + ', '.join(f"{k} {state['config'][k]!r}, not {cfg[k]!r}" for k in differ)
             + "; choose another out_dir for a new run")
    if state is not None and state['step'] > cfg['steps']:
        fail(f"--resume=True: the newest checkpoint is at step {state['step']}, past steps={cfg['steps']}")
    if cfg['resume'] and not old and metrics:  # killed before its first checkpoint, or they were moved away
        fail(f"--resume=True: {cfg['out_dir']} holds metrics.jsonl but no checkpoint to continue from; "
             f"--overwrite=True replaces the run, or choose another out_dir")
    if state is None and (old or metrics) and not cfg['overwrite']:
        fail(f"{cfg['out_dir']} holds an earlier run ({len(old)} checkpoint(s), metrics.jsonl "
             f"{'present' if metrics else 'absent'}): --resume=True continues it, "
             f"--overwrite=True replaces it, or choose another out_dir")


def start_or_resume(cfg, model, opt, gym_, rng, gen, ckpt):
    """A fresh run (warm start, reference copy, step-0 evaluation, ckpt_000000) or the newest checkpoint's state
    (weights, optimizer, reference, RNG streams, metrics truncated to its step). A fresh run never
    deletes another run's checkpoints unless overwrite=True. ckpt: load_latest_checkpoint()'s (state,
    path), or (None, None). Returns (start step, ref_model or None)."""
    metrics_path = os.path.join(cfg['out_dir'], 'metrics.jsonl')
    old = sorted(glob.glob(os.path.join(cfg['out_dir'], report.CHECKPOINTS)))
    state, path = ckpt
    for p in [p for p in old if path is not None and p > path] if rank() == 0 else []:  # skipped as corrupt:
        os.replace(p, p + '.corrupt')  # kept, but out of the rotation, which would keep it and drop a good one
        print(f"--resume=True: {p} did not load; renamed to {os.path.basename(p)}.corrupt")
    if cfg['resume'] and state is None and rank() == 0:
        print(f"--resume=True: no checkpoint in {cfg['out_dir']}, starting from scratch")
    if state is None:
        dumps = sorted(glob.glob(os.path.join(cfg['out_dir'], 'rollout_*.pt'))) if cfg['overwrite'] else []  # dump_rollouts'
        if (old or dumps) and rank() == 0:
            print(f"overwrite: removing {len(old)} checkpoint(s) and {len(dumps)} rollout dump(s) of an earlier run "
                  f"in {cfg['out_dir']}")
            for p in old + dumps:
                os.remove(p)
        t0 = time.time()
        try:
            sft_loss = warm_start(model, gym_, cfg, rng)  # identical on every rank (same seed, same data)
        except (OutOfVocabulary, GymContractError) as e:  # the gym's texts or its env, not a bug here: one line
            fail(f'warm start: {e}')
        if sft_loss is not None and rank() == 0:
            print(f'warm start: {cfg["warmstart_steps"]} steps, loss {sft_loss:.3f} (mean of the last {min(10, cfg["warmstart_steps"])}), {time.time() - t0:.0f}s')
        fold_lora(model)  # LoRA: the warm start's update goes into the base weights, the reference's
        ref_model = reference_of(model) if cfg['kl_coef'] else None
        log0 = dict(step=0, **evaluate(model, gym_, cfg, 0))
        if rank() == 0:  # step 0: the warm-started policy, before any RL
            report.print_eval(log0, gym_)
            with open(metrics_path, 'w') as f:
                f.write(json.dumps(log0) + '\n')
            report.log_external(cfg, log0, 0)
        save(cfg, 0, model, opt, ref_model, gym_, rng, gen)  # --resume skips the warm start (SmolLM2: half an hour)
        return 0, ref_model
    report.load_weights(model, state, cfg, path, opt)
    ref_model = reference_of(model) if cfg['kl_coef'] else None
    if ref_model is not None and ref_model is not model:  # a copy of its own (LoRA's is the base weights)
        if state.get('ref_model') is not None:
            ref_model.load_state_dict(state['ref_model'])
        elif state['step'] > 0:  # at step 0 the loaded, warm-started weights are the reference a fresh run takes
            fail(f"{path} has no KL reference (its run had kl_coef 0): resume with kl_coef 0, or from its "
                 f"ckpt_000000 (whose weights are the reference a fresh run would take)")
    rng.setstate(state['rng']['python'])
    torch.set_rng_state(state['rng']['torch'])
    gen.set_state(state['rng']['gen'][min(rank(), len(state['rng']['gen']) - 1)])
    if rank() == 0:  # metrics logged after the checkpoint belong to steps that will run again
        lines = [json.dumps(r) + '\n' for r in report.read_metrics(metrics_path) if r['step'] <= state['step']] \
            if os.path.exists(metrics_path) else []  # read_metrics skips a line torn by a kill
        open(metrics_path, 'w').writelines(lines)
        print(f"resumed from {path} at step {state['step']}")
    return state['step'], ref_model


# -----------------------------------------------------------------------------


def learning_rate(step, cfg):
    """The RL learning rate at step (1-based): a linear warm-up over warmup_steps, then constant, or with
    min_lr >= 0 a cosine decay to min_lr at the last step (as nanoGPT's get_lr)."""
    warmup = max(1, cfg['warmup_steps'])
    if step < warmup or cfg['min_lr'] < 0:
        return cfg['lr'] * min(1.0, step / warmup)
    frac = (step - warmup) / max(1, cfg['steps'] - warmup)
    return cfg['min_lr'] + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg['lr'] - cfg['min_lr'])


def init_run(cfg):
    """Threads, out_dir, seeds, the newest checkpoint (resume), the gym and the policy. Returns
    (gym_, model, rng, gen, (state, path)); every bad input exits 2 with one line."""
    if cfg['device'].startswith('cuda') and not torch.cuda.is_available():
        fail(f"config key 'device' is {cfg['device']!r} but torch sees no CUDA device (use --device=cpu)")
    gym_module(cfg, config)  # an unknown gym or a key it ignores: one line, before anything is printed or made
    ckpt = report.load_latest_checkpoint(cfg['out_dir'], 'run without --resume') if cfg['resume'] else (None, None)
    check_out_dir(cfg, ckpt[0])  # an earlier run in out_dir: likewise
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    random.seed(cfg['seed'])
    torch.manual_seed(cfg['seed'])
    rng = random.Random(cfg['seed'])  # the same on every rank: all ranks draw the same tasks
    gen = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'] + rank())  # sampling differs per rank
    t0 = time.time()
    gym_ = load_gym(cfg, ckpt[0].get('vocab') if ckpt[0] else None, config)  # bad data or config: exit 2
    try:
        check_prompts_fit(gym_, cfg)
        model = load_policy(cfg, gym_['tok'].vocab_size)
    except (OSError, ValueError) as e:  # GymContractError too: a reset that returns no text
        fail(str(e).splitlines()[0])
    if rank() == 0:  # only once the gym and the policy are set up: a refusal above prints nothing first
        print(json.dumps(cfg))
    try:  # only now: a set-up that fails leaves no empty out_dir behind
        os.makedirs(cfg['out_dir'], exist_ok=True)
    except OSError as e:
        fail(f"cannot create out_dir {cfg['out_dir']!r}: {e.strerror}")
    if rank() == 0:
        print(f"gym {cfg['gym']}: {len(gym_['train_tasks'])} train / {len(gym_['eval_tasks'])} held-out tasks "
              f"({time.time() - t0:.0f}s); policy {cfg['model']}, {count_params(model) / 1e6:.2f}M parameters"
              + (f" ({sum(p.numel() for p in model.parameters() if p.requires_grad):,} trained: LoRA rank "
                 f"{cfg['lora_rank']})" if cfg['lora_rank'] else '') + f"; {world_size()} process(es)")
        if cfg['kl_type'] == 'k1' and cfg['kl_coef']:
            print("warning: kl_type=k1 as a loss has zero gradient in expectation: the KL term holds nothing "
                  "back (use k2 or k3)", file=sys.stderr)
        if cfg['group_size'] == 1:
            print("warning: group_size=1: a group of one is its own baseline, so every outcome advantage is 0 "
                  "and RL learns only from the memory advantage and the KL term", file=sys.stderr)
        report.open_external(cfg)  # a missing tensorboard / wandb is said now, not after the step-0 evaluation
    return gym_, model, rng, gen, ckpt


def write_config(cfg):
    """out_dir/config.json: the config this run trains with (sample.py --untrained reads it)."""
    with open(os.path.join(cfg['out_dir'], 'config.json'), 'w') as f:
        json.dump(cfg, f, indent=1)


def main(argv):
    t_start = time.time()
    cfg = load_config(argv)
    ddp = init_distributed(cfg)
    master = rank() == 0
    gym_, model, rng, gen, ckpt = init_run(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']),
                            weight_decay=cfg['weight_decay'])
    if master and ckpt[0] is None:  # before the warm start: a run stopped during it still says what it was
        write_config(cfg)
    start, ref_model = start_or_resume(cfg, model, opt, gym_, rng, gen, ckpt)
    if master and ckpt[0] is not None and start < cfg['steps']:  # only once the checkpoint fits and there is
        write_config(cfg)  # something to train: a refused or finished resume leaves the run's config as it was
    metrics_path = os.path.join(cfg['out_dir'], 'metrics.jsonl')
    if master:
        metrics_file = open(metrics_path, 'a')
    bad_steps = 0
    for step in report.progress(range(start + 1, cfg['steps'] + 1), 'RL', cfg, initial=start, total=cfg['steps'],
                                show=master):
        t0 = time.time()
        lr = learning_rate(step, cfg)
        for g in opt.param_groups:
            g['lr'] = lr
        m, trajs, batch, adv = train_step(model, ref_model, opt, gym_, cfg, rng, gen)
        log = dict(step=step, lr=lr, **m, step_time_s=time.time() - t0)
        log['tokens_per_s'] = log['tokens'] / log['step_time_s']
        bad_steps = bad_steps + 1 if m['bad_steps'] else 0
        if step == cfg['steps'] or (cfg['eval_every'] and step % cfg['eval_every'] == 0):
            log.update(evaluate(model, gym_, cfg, step))
            if master:
                report.print_eval(log, gym_)
                if cfg['dump_rollouts']:
                    report.dump_rollout(os.path.join(cfg['out_dir'], f'rollout_{step:06d}.pt'), trajs, batch, adv, cfg, step)
        if master:
            metrics_file.write(json.dumps(log) + '\n')
            metrics_file.flush()
            report.log_external(cfg, log, step)
            if 'eval_success_rate' in log:  # an eval step: redraw the curves
                report.plot_metrics(metrics_path, os.path.join(cfg['out_dir'], report.CURVES))
        if bad_steps >= cfg['max_bad_steps']:
            print(f'error: stopping at step {step}: {bad_steps} steps in a row had a non-finite loss '
                  f'(max_bad_steps={cfg["max_bad_steps"]})', file=sys.stderr)
            sys.exit(1)
        if step == cfg['steps'] or (cfg['save_every'] and step % cfg['save_every'] == 0):
            save(cfg, step, model, opt, ref_model, gym_, rng, gen)
    if master:
        if cfg['model'] != 'tiny':  # a trained HF policy that transformers or vLLM can load and serve
            merged(model).save_pretrained(os.path.join(cfg['out_dir'], 'hf'), safe_serialization=True)  # LoRA folded in
            gym_['tok'].save_pretrained(os.path.join(cfg['out_dir'], 'hf'))
        report.plot_metrics(metrics_path, os.path.join(cfg['out_dir'], report.CURVES))
        print(report.run_summary(cfg['out_dir'], cfg, time.time() - t_start))
    if ddp:  # wait for rank 0's final files: a rank that tears gloo down alone can abort (seen under load)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (OutOfVocabulary, GymContractError) as e:  # a gym's mistake met during RL or an evaluation
        fail(str(e))
    except KeyboardInterrupt:  # one line, not a traceback: what was saved is kept
        print("\ninterrupted: what out_dir holds is kept (a checkpoint once the warm start and the step-0 evaluation "
              "are done, then every save_every RL steps); --resume=True continues from the newest checkpoint, or "
              "starts over without one", file=sys.stderr)
        sys.exit(130)
