"""
Train a language-model agent with multi-turn RL: rollout -> rewards -> advantages -> PPO.

    python train.py config/tiny.yaml --steps=50 --seed=2

Top to bottom: the loss (the function a forker swaps), the PPO update, evaluation and the warm
start, set-up, then main(), whose loop is one RL step in order: learning rate, draw tasks, roll out
(optionally keeping the groups with signal), weigh invalid episodes 0, collate, reference log-probs,
advantages, PPO update, log, evaluate, save.

Simplifications, on purpose:
1. No value model: GRPO's group baseline replaces it (no GAE, no bootstrapping at truncation;
   truncated episodes get reward 0, less truncation_penalty for GRPO, and count in truncation_rate).
2. The old log-probs are the sampler's own (exact in float32, checked every step as logp_gap_max on
   the first mini-batch, before any update), so no separate old-policy forward pass runs; with
   tis_cap (for bf16) one runs over every mini-batch but the first, whose own forward gives them.
3. The warm start is plain cross-entropy on the policy tokens of scripted episodes.
"""

import math
import os
import random
import sys
import time

import torch

import report
from advantage import compute_advantages, keep_groups_with_signal, tis_weights
from config import all_reduce, check_run, config, fail, gather, init_distributed, load_config, load_saved_config, rank, sync_gradients, world_size  # noqa: F401
from gym import GymContractError, OutOfVocabulary, load_gym
from model import (autocast, batch_log_probs, batch_rows, fold_lora, is_reference, load_policy, merged, micro_batches,
                   peak_memory_gb, reference_log_probs, reference_of, release_memory, sequence_log_probs, update_mode)
from rollout import EVAL_EPISODES_PER_BATCH, EVAL_PREFIX, SPLIT_NAMES, collate, episode_rows, eval_generator, full_history_row, run_tasks

# -----------------------------------------------------------------------------
# the loss: one short function a forker replaces (README, "Swap the loss")

LOG_RATIO_MAX = 20.0  # exp(20) = 4.9e8 is finite in float32; beyond the clamp a token has no gradient
KL_MAX = 10.0         # bound on a token's KL estimate; its gradient is 0 beyond it (verl bounds it too)


def kl_penalty(logp, ref_logp, kl_type):
    """Per-token KL estimate [b, L-1] of the policy from the reference (Schulman 2020, "Approximating
    KL divergence"): k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1, log r = logp - ref.
    Clamped so exp cannot overflow and no token's gradient exceeds 12.6 x kl_coef. k1 as a loss has
    zero gradient in expectation: it is a reward penalty (REINFORCE++); as a loss use k2 or k3."""
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

    logp [b, L-1] current log-probs (with gradient); old_logp, advantages, mask (1 on trained policy
    tokens), weights (loss_weights), ref_logp (or None): [b, L-1]. The log-ratio is clamped before
    exp: one bad stored log-prob gives no gradient instead of inf and a lost mini-batch.
    Returns (loss: scalar, the weighted sum of per-token losses; stats). A replacement must return
    the stats ppo_update logs, each [b, L-1]: ratio, clipped (bool: the surrogate's gradient is 0
    there), clamped (bool: the log-ratio hit LOG_RATIO_MAX) and kl (or None without a reference)."""
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
    """Per-token weights [R, T-1] whose weighted sum is the mini-batch loss, computed before the
    mini-batch is split into micro-batches, so the gradient cannot depend on the split. mask [R, T-1]
    (1 on trained tokens), row_episode [R]; n_tokens, n_episodes: totals over all ranks. Rules:
    token-mean 1 / n_tokens; seq-mean 1 / (the episode's tokens x n_episodes); drgrpo 1 /
    (max_episode_tokens x n_episodes) (Liu et al. 2025, Dr.GRPO, §3.1). Empty: weights 0."""
    per_ep = torch.zeros(int(row_episode.max()) + 1 if len(row_episode) else 0).index_add_(0, row_episode, mask.sum(1))
    n_tokens = float(mask.sum()) if n_tokens is None else n_tokens
    n_episodes = float((per_ep > 0).sum()) if n_episodes is None else n_episodes
    if loss_agg == 'token-mean':
        return mask / max(n_tokens, 1.0)
    if loss_agg == 'seq-mean':
        return mask / (per_ep[row_episode].clamp(min=1)[:, None] * max(n_episodes, 1.0))
    return mask / (max_episode_tokens * max(n_episodes, 1.0))


# -----------------------------------------------------------------------------
# the PPO update


def ppo_update(model, opt, batch, adv, ref_logp, cfg, rng, episode_ids=None, n_global=None, at_reference=False,
               scripted=None):
    """ppo_epochs passes over shuffled mini-batches of episodes, one optimizer step each. batch:
    collate() of this rank's episodes; adv, ref_logp (or None) [R, T-1]; at_reference: is_reference().
    A mini-batch without signal (no advantage on a trained token and a KL term of 0) takes no step:
    Adam would turn its rounding gradient into a full step. A non-finite loss or gradient skips the
    step (bad_steps). tis_cap (>= 1): PPO's old log-probs are the trainer's (batch_log_probs; the first
    mini-batch's from its own forward) and each token's surrogate is weighted by tis_weights.
    skip_zero_advantage (without a KL term): rows whose advantages are all 0 are left out of every
    forward and backward but kept in the normaliser, so the step is the same up to rounding; the
    logged means (entropy, clip_frac, logp gap) are then over the rows computed (None when none was).
    Data parallel: episode_ids [N] index this rank's episodes in the global batch of n_global,
    shuffled alike on every rank with global normalisers, so N ranks take the step of one process.
    scripted (scripted_episodes and an rng of their own, with sft_coef > 0): the first mini-batch's
    gradient also gets sft_coef x the warm start's imitation loss on sft_batch_size scripted
    episodes drawn with scripted['rng'] (PPO-ptx: Ouyang et al. 2022, "Training language models to
    follow instructions", §3.5), logged as sft_loss (nats per policy token, before the step) and
    sft_time_s (its forward and backward, seconds; part of the update's time, which also counts the
    optimizer step a first mini-batch without RL signal then takes).
    Returns a dict of metrics."""
    episode_ids = torch.arange(len(batch['rewards'])) if episode_ids is None else episode_ids
    n_global = n_global or len(batch['rewards'])
    mask = batch['action_mask'] * batch['valid'][batch['row_episode']][:, None]  # [R, T-1]; invalid episodes weigh 0
    row_global = episode_ids[batch['row_episode']]  # [R]
    max_ep_tokens = cfg['max_turns'] * cfg['max_response_tokens']
    sums = dict(clip_frac=0.0, kl=0.0, entropy=0.0, tokens=0.0, loss=0.0, log_ratio_clamped=0.0)
    m = dict(grad_norm=0.0, logp_gap_max=0.0, ratio_dev_first_minibatch=0.0, bad_steps=0, gap_sum=0.0, gap_n=0)
    first, n_steps = True, cfg['ppo_epochs'] * cfg['mini_batches']
    no_kl = ref_logp is None or not cfg['kl_coef']
    kl_free = no_kl or (at_reference and cfg['kl_type'] != 'k1')  # at the reference k2, k3 have gradient 0; k1 not
    update_mode(model)
    # without a KL term a row whose advantages are all 0 has gradient 0: its forward and backward can go
    trained = ((adv != 0) & mask.bool()).any(1) if cfg['skip_zero_advantage'] and no_kl \
        else torch.ones(len(mask), dtype=torch.bool)  # [R]
    plan = []  # per epoch, the rows [r] of each mini-batch
    for epoch in range(cfg['ppo_epochs']):
        order = list(range(n_global))
        rng.shuffle(order)
        plan.append([torch.nonzero(torch.isin(row_global, torch.tensor(order[i::cfg['mini_batches']]))).squeeze(1)
                     for i in range(cfg['mini_batches'])])
    old = batch['sample_logp']  # [R, T-1]; exact in float32 (logp_gap_max)
    mask_t = mask * trained[:, None]  # [R, T-1]: the tokens the update computes
    if cfg['tis_cap']:  # bf16: the trainer's own old log-probs, batched as the first epoch's forwards, before any
        # step; the first mini-batch's rows come from its own forward (minibatch_loss): the same bits, a pass less
        old = batch_log_probs(model, batch, cfg, [rows[trained[rows]] for rows in plan[0][1:]], mask_t)
    for rows in [rows for epoch in plan for rows in epoch]:
        signal = not kl_free or all_reduce(float(((adv[rows] != 0) & mask[rows].bool()).sum())) > 0
        per_ep = torch.zeros(n_global).index_add_(0, row_global[rows], mask[rows].sum(1))
        w = loss_weights(mask[rows], row_global[rows], cfg['loss_agg'], max_ep_tokens,
                         n_tokens=all_reduce(float(per_ep.sum())), n_episodes=all_reduce(float((per_ep > 0).sum())))
        opt.zero_grad(set_to_none=True)
        keep = trained[rows]  # the normaliser above counts every row; only rows with signal are computed
        total = all_reduce(minibatch_loss(model, batch, rows[keep], mask, w[keep], adv, old, ref_logp, cfg, signal, sums,
                                          m if first else None, mask_t if first and cfg['tis_cap'] else None))
        if first and scripted is not None:  # PPO-ptx: keep imitating the scripted policy (docstring)
            t0 = time.time()
            sft_loss = warm_start_loss(model, scripted['batch'], draw_episodes(scripted, cfg['sft_batch_size'],
                                                                               scripted['rng']), cfg)
            (cfg['sft_coef'] / world_size() * sft_loss).backward()  # every rank draws the same: summed once
            m['sft_loss'], m['sft_time_s'], signal = sft_loss.item(), time.time() - t0, True
        if first and cfg['tis_cap']:  # every old log-prob known: weight each token for the sampler's
            tis = tis_weights(old, batch['sample_logp'], mask_t, cfg['tis_cap'])
            adv = adv * tis  # a positive weight on the clipped surrogate, the KL term untouched
            m.update(tis_sum=float((tis * mask_t).sum()), tis_capped=float(((tis >= cfg['tis_cap']) & mask_t.bool()).sum()),
                     tis_n=float(mask_t.sum()))
        first = False
        if signal:  # else the true gradient is 0 (docstring): no step, not even AdamW's weight decay
            sync_gradients(model)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'] or math.inf))
            if not (math.isfinite(total) and math.isfinite(grad_norm)):
                m['bad_steps'] += 1  # a non-finite loss never reaches the weights
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            kl_free = no_kl  # the policy has left the reference
            m['grad_norm'] = max(m['grad_norm'], grad_norm)
        sums['loss'] += total / n_steps
    return update_metrics(sums, m, ref_logp is not None, n_steps)


def minibatch_loss(model, batch, rows, mask, w, adv, old_logp, ref_logp, cfg, backward, sums, first=None, tis_mask=None):
    """Forward (and with backward, backward) the micro-batches of rows [r] of batch, w [r, T-1] their
    loss weights, old_logp [R, T-1] PPO's old log-probs, adding the update's statistics to sums.
    first: the metrics dict on a step's first mini-batch, before any update: the gap of the sampler's
    log-probs to the trainer's (logp_gap_max, _mean), and every ratio 1. tis_mask [R, T-1] (tis_cap,
    first mini-batch): its forward is the trainer's old log-probs, written into old_logp, and its
    advantages are weighted by tis_weights over the whole batch (the same numbers as a no-grad pass
    before the step, one forward less). Returns this rank's loss."""
    dev, total = cfg['device'], 0.0
    lengths = batch['attention_mask'].sum(1).tolist()
    for mb in micro_batches([lengths[i] for i in rows.tolist()], cfg['max_tokens_per_microbatch']):
        r = rows[mb]
        L = max(lengths[i] for i in r.tolist())
        if not mask[r, :L - 1].any():  # checked on the CPU copy: no device sync per micro-batch
            continue  # nothing to train here (invalid episodes): loss 0, gradient 0
        am = mask[r, :L - 1].to(dev)
        ids, attn, seg = batch_rows(batch, r, L, dev)
        with autocast(cfg):
            logp, ent = sequence_log_probs(model, ids, attn, cfg['temperature'], with_entropy=True, positions=am, segments=seg)
        a = adv[r, :L - 1]
        if tis_mask is not None:  # tis_weights on the whole [R, T-1]: each entry rounds as in one pass
            old_logp[r, :L - 1] = logp.detach().cpu()
            a = (adv * tis_weights(old_logp, batch['sample_logp'], tis_mask, cfg['tis_cap']))[r, :L - 1]
        old = old_logp[r, :L - 1].to(dev)
        ref = ref_logp[r, :L - 1].to(dev) if ref_logp is not None else None
        loss, st = policy_loss(logp, old, a.to(dev), am, w[mb, :L - 1].to(dev), cfg, ref)
        if backward:  # else the loss is only logged
            loss.backward()
        total += loss.item()
        with torch.no_grad():
            pol = am.bool()
            sums['clip_frac'] += float((st['clipped'] & pol).sum())
            sums['log_ratio_clamped'] += float((st['clamped'] & pol).sum())
            sums['kl'] += float((st['kl'].detach() * am).sum()) if st['kl'] is not None else 0.0
            sums['entropy'] += float((ent * am).sum())
            sums['tokens'] += float(am.sum())
            if first is not None:
                gap = (logp - batch['sample_logp'][r, :L - 1].to(dev)).abs()[pol]
                first['logp_gap_max'] = max(first['logp_gap_max'], float(gap.max()))
                first['gap_sum'], first['gap_n'] = first['gap_sum'] + float(gap.sum()), first['gap_n'] + len(gap)
                first['ratio_dev_first_minibatch'] = max(first['ratio_dev_first_minibatch'],
                                                         float((st['ratio'] - 1).abs()[pol].max()))
    return total


def update_metrics(sums, m, with_kl, n_steps):
    """The update's metrics over all ranks: means over policy tokens, the mean loss, maxima; loss and
    grad_norm are None when every step was non-finite, kl None without a reference, and a mean or
    maximum None when no token was computed for it (every row skipped: nothing measured, not 0)."""
    sums = {k: all_reduce(v) for k, v in sums.items()}
    m['loss'] = sums['loss'] / world_size()
    for k in ('clip_frac', 'kl', 'entropy'):
        m[k] = sums[k] / sums['tokens'] if sums['tokens'] else None
    m['log_ratio_clamped'] = sums['log_ratio_clamped']  # tokens whose log-ratio hit +-LOG_RATIO_MAX
    gap_n, gap_sum = all_reduce(m.pop('gap_n')), all_reduce(m.pop('gap_sum'))  # the first mini-batch's tokens
    for k in ('logp_gap_max', 'ratio_dev_first_minibatch'):
        m[k] = all_reduce(m[k], 'max') if gap_n else None  # gap_n is every rank's: all take one branch
    m['logp_gap_mean'] = gap_sum / gap_n if gap_n else None
    if 'tis_n' in m:  # tis_cap
        n, w, capped = all_reduce(m.pop('tis_n')), all_reduce(m.pop('tis_sum')), all_reduce(m.pop('tis_capped'))
        m['tis_weight_mean'], m['tis_capped_frac'] = (w / n, capped / n) if n else (None, None)
    if not with_kl:
        m['kl'] = None
    if m['bad_steps'] == n_steps:  # every step skipped: no loss, not a loss of 0
        m['loss'] = m['grad_norm'] = None
    return m


# -----------------------------------------------------------------------------
# evaluation and the warm start


@torch.no_grad()
def evaluate(model, gym_, cfg, step):
    """Held-out success, greedy (one episode per task) and sampled (eval_samples per task), tasks
    sharded over ranks. Each split samples from its own generator (rollout.eval_generator), seeded by
    the step: evaluating never shifts training's random streams, and sample.py --eval of the step's
    checkpoint prints the same numbers. A validation split (gym_['val_tasks']) gets the same as
    eval_val_*. Recipes are chosen on validation, never on held-out."""
    splits = [('eval_tasks', 'eval_sampled_success')] + ([('val_tasks', 'eval_val_success')] if gym_.get('val_tasks') else [])
    out = {}
    for split, sampled_key in splits:
        prefix = EVAL_PREFIX[split]
        greedy_key = prefix + 'greedy_success'
        tasks, gen = gym_[split][rank()::world_size()], eval_generator(cfg, split, step, rank())
        for key, temp, reps in [(greedy_key, 0.0, 1), (sampled_key, cfg['temperature'], cfg['eval_samples'])]:
            per_batch = max(1, EVAL_EPISODES_PER_BATCH // reps)  # bounded memory however many tasks are asked for
            trajs = [t for i in range(0, len(tasks), per_batch)
                     for t in run_tasks(model, gym_, cfg, tasks[i:i + per_batch], reps, generator=gen, temperature=temp)]
            report.check_invalid(trajs, f"evaluation ({SPLIT_NAMES[split]}, {'greedy' if temp == 0 else 'sampled'})")
            eps = gather([report.summarise(t) for t in trajs])
            m = report.episode_metrics(eps, prefix)
            if key == greedy_key:  # success, and on memory gyms success by parts (greedy_success_k1..)
                success = prefix + 'success_rate'
                out.update({key + k[len(success):]: v for k, v in m.items() if k.startswith(success)})
                out[prefix + 'greedy_invalid_episodes'] = m[prefix + 'invalid_episodes']
            else:
                out[key] = m[prefix + 'success_rate']
                out.update(m)
    return dict(out, **{f'eval_baseline_{k}': v for k, v in gym_['baselines'].items()})


def warm_start_loss(model, batch, idx, cfg):
    """Mean negative log-likelihood (nats per policy token) of the policy tokens of rows idx [n] of a
    collated batch. Every position is projected (only the policy tokens would round differently). Rows
    run in micro-batches of similar length (max_tokens_per_microbatch), each in idx's order, so a long
    full-history row (warmstart_full) does not pad the short folded ones."""
    lengths = batch['attention_mask'][idx].sum(1).tolist()
    parts, nll = micro_batches(lengths, cfg['max_tokens_per_microbatch']), 0.0
    for part in parts:
        rows, L = idx[sorted(part)], max(lengths[i] for i in part)
        ids, attn, seg = batch_rows(batch, rows, L, cfg['device'])
        with autocast(cfg):  # one backward over every part: each keeps a share of the log-softmax bound
            logp = sequence_log_probs(model, ids, attn, kept_share=1 / len(parts), segments=seg)
        nll = nll - (logp * batch['action_mask'][rows, :L - 1].to(cfg['device'])).sum()
    return nll / batch['action_mask'][idx].sum().clamp(min=1).to(cfg['device'])


def scripted_episodes(gym_, cfg, rng, what='warm start'):
    """warmstart_episodes episodes of the gym's scripted policy on training tasks drawn with rng, rolled
    out by the same code as RL and collated (warmstart_full adds each folded episode's full-history row);
    what (the warm start, PPO-ptx) names them in warnings.
    Returns dict(batch=collate(...), rows=[the batch rows of each episode]); episodes the env made
    invalid are left out. Raises what run_tasks raises (OutOfVocabulary, GymContractError)."""
    n = cfg['warmstart_episodes']
    tasks = [rng.choice(gym_['train_tasks']) for _ in range(n)]
    policies = [gym_['warm_policy'](rng) for _ in range(n)]
    trajs = run_tasks(policies, gym_, cfg, tasks)
    report.check_invalid(trajs, what)
    cut = sum(u['finish'] == 'length' and u['train'] for t in trajs for u in t.turns)
    if cut and rank() == 0:  # the policy would learn a turn that never ends
        print(f"warning: {what}: {cut} of {sum(len(t.turns) for t in trajs)} scripted turns are cut at max_response_"
              f"tokens={cfg['max_response_tokens']}; raise it so that whole turns are imitated", file=sys.stderr)
    trajs = [t for t in trajs if t.valid]  # as in RL, an invalid episode (the env raised) is not trained on
    for t in trajs if cfg['warmstart_full'] and cfg['keep_tool_results'] != 'all' else []:
        t.rows.append(full_history_row(t, cfg['max_len']))  # also read the un-folded history (MemPO's P_full)
    batch = collate(trajs, gym_['fmt'].pad_id, cfg['pack_turns'])
    return dict(batch=batch, rows=episode_rows(batch['row_episode'], len(trajs)))


def draw_episodes(scripted, n, rng):
    """The batch rows [r] of n scripted episodes drawn with rng (with replacement), all rows of each."""
    return torch.tensor([r for _ in range(n) for r in scripted['rows'][rng.randrange(len(scripted['rows']))]])


def warm_start(model, gym_, cfg, rng):
    """Cross-entropy on the policy tokens of scripted episodes (scripted_episodes). A step draws
    warmstart_batch_size episodes with all their rows (folded or not, the same turns).
    Returns the mean loss of the last 10 steps (nats per policy token), or None without one."""
    if cfg['warmstart_episodes'] == 0 or cfg['warmstart_steps'] == 0 or gym_['warm_policy'] is None:
        return None
    scripted = scripted_episodes(gym_, cfg, rng)
    batch = scripted['batch']
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['warmstart_lr'], weight_decay=0.0)
    model.train()
    losses = []
    for it in report.progress(range(cfg['warmstart_steps']), 'warm start', cfg, lambda: f'loss {losses[-1]:.3f}',
                              show=rank() == 0):
        # 30-step ramp (a fifth of a warm start shorter than 40 steps), then cosine decay to 10%: the
        # scripted targets are deterministic, and at a constant lr the loss stays noisy (docs/RESULTS.md)
        frac, ramp = it / cfg['warmstart_steps'], 30 if cfg['warmstart_steps'] >= 40 else max(1, cfg['warmstart_steps'] // 5)
        for g in opt.param_groups:
            g['lr'] = cfg['warmstart_lr'] * min(1.0, (it + 1) / ramp) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        idx = draw_episodes(scripted, cfg['warmstart_batch_size'], rng)  # a step draws episodes, not rows
        loss = warm_start_loss(model, batch, idx, cfg)
        losses.append(loss.item())
        if not batch['action_mask'][idx].any():  # only scripted mistakes drawn: nothing to imitate, and
            continue  # Adam's momentum would still move the weights
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'] or math.inf)
        opt.step()
    return sum(losses[-10:]) / len(losses[-10:])


# -----------------------------------------------------------------------------
# set-up, the run


def learning_rate(step, cfg):
    """The RL learning rate at step (1-based): a linear warm-up over warmup_steps, then constant, or with
    min_lr >= 0 a cosine decay to min_lr at the last step (as nanoGPT's get_lr)."""
    warmup = max(1, cfg['warmup_steps'])
    if step < warmup or cfg['min_lr'] < 0:
        return cfg['lr'] * min(1.0, step / warmup)
    frac = (step - warmup) / max(1, cfg['steps'] - warmup)
    return cfg['min_lr'] + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg['lr'] - cfg['min_lr'])


def setup(cfg, ckpt):
    """Threads, seeds, the gym (with a resumed checkpoint's vocabulary) and the policy. Returns
    (gym_, model, rng, gen): rng draws tasks (the same on every rank), gen samples (one per rank)."""
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    random.seed(cfg['seed'])
    torch.manual_seed(cfg['seed'])
    rng = random.Random(cfg['seed'])
    gen = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'] + rank())
    t0 = time.time()
    gym_ = load_gym(cfg, ckpt[0].get('vocab') if ckpt else None, config)  # bad data or config: exit 2
    try:
        model = load_policy(cfg, gym_['tok'].vocab_size)
    except (OSError, ValueError) as e:
        fail(str(e).splitlines()[0])
    if rank() == 0:  # only once the gym and the policy are set up: a refusal above prints nothing first
        report.print_setup(cfg, gym_, model, time.time() - t0, world_size())
    return gym_, model, rng, gen


def save(cfg, step, model, opt, ref_model, gym_, rng, gen):
    """out_dir/ckpt_<step>.pt, one dict: weights, optimizer, KL reference (unless it is the policy),
    every random stream (all ranks' samplers), config, the tiny model's vocabulary. Every rank calls it."""
    gens = gather([gen.get_state()])
    if rank() == 0:
        report.save_checkpoint(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step, config=cfg,
                                    rng=dict(python=rng.getstate(), torch=torch.get_rng_state(), gen=gens),
                                    ref_model=ref_model.state_dict() if ref_model not in (None, model) else None,
                                    vocab=getattr(gym_['tok'], 'itos', None)),
                               cfg['out_dir'], step, cfg['keep_checkpoints'])


def begin(cfg, model, opt, gym_, rng, gen, ckpt):
    """A fresh run: warm start, KL reference, step-0 evaluation and checkpoint (which --resume skips
    to). A resumed run: report.restore. Returns (start step, ref_model or None)."""
    if ckpt is not None:
        step, ref_state = report.restore(ckpt, cfg, model, opt, rng, gen, rank())
        ref_model = reference_of(model) if cfg['kl_coef'] else None
        if ref_state is not None and ref_model is not model:
            ref_model.load_state_dict(ref_state)
        return step, ref_model
    report.start_fresh(cfg, rank() == 0)
    t0 = time.time()
    try:
        sft_loss = warm_start(model, gym_, cfg, rng)  # identical on every rank (same seed, same data)
    except (OutOfVocabulary, GymContractError) as e:  # the gym's texts or its env, not a bug here: one line
        fail(f'warm start: {e}')
    if sft_loss is not None and rank() == 0:
        print(f'warm start: {cfg["warmstart_steps"]} steps, loss {sft_loss:.3f} (mean of the last '
              f'{min(10, cfg["warmstart_steps"])}), {time.time() - t0:.0f}s')
    fold_lora(model)  # LoRA: the warm start's update goes into the base weights, the reference's
    ref_model = reference_of(model) if cfg['kl_coef'] else None
    warmstart_time_s, t0 = time.time() - t0, time.time()
    log = dict(step=0, **evaluate(model, gym_, cfg, 0))  # the warm-started policy, before any RL
    log.update(warmstart_time_s=warmstart_time_s, eval_time_s=time.time() - t0)
    if rank() == 0:
        report.log_step(cfg, log, gym_)
    save(cfg, 0, model, opt, ref_model, gym_, rng, gen)
    return 0, ref_model


def main(argv):
    t_start = time.time()
    cfg = load_config(argv)
    if cfg['resume']:  # the run's own settings, with what argv sets on top (check_out_dir warns of those)
        cfg = load_saved_config(argv, report.resume_base(cfg['out_dir'], argv))
    ddp = init_distributed(cfg)
    master = rank() == 0
    check_run(cfg, master)  # the device, the gym's name and keys: one line, before anything is made
    ckpt = report.check_out_dir(cfg, master)  # an earlier run in out_dir, or --resume's checkpoint
    gym_, model, rng, gen = setup(cfg, ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']),
                            weight_decay=cfg['weight_decay'])
    start, ref_model = begin(cfg, model, opt, gym_, rng, gen, ckpt)
    # PPO-ptx's scripted episodes: their own draw, so RL's task draws are those of a run without them
    scripted = scripted_episodes(gym_, cfg, random.Random(f"sft:{cfg['seed']}"), 'PPO-ptx (sft_coef)') \
        if cfg['sft_coef'] and start < cfg['steps'] else None
    bad_steps = 0
    for step in report.progress(range(start + 1, cfg['steps'] + 1), 'RL', cfg, initial=start, total=cfg['steps'],
                                show=master):
        t0, lr = time.time(), learning_rate(step, cfg)
        for g in opt.param_groups:
            g['lr'] = lr
        # draw tasks, the same on every rank; each rank rolls out whole groups of its own
        n_groups = math.ceil(cfg['batch_size'] * cfg['oversample'])
        tasks = [rng.choice(gym_['rl_tasks']) for _ in range(n_groups)]
        mine = list(range(rank(), n_groups, world_size()))
        # roll out: token-in/token-out episodes, sampled log-probs kept (rollout.py)
        trajs = run_tasks(model, gym_, cfg, [tasks[g] for g in mine], cfg['group_size'], mine, gen)
        rollout_time_s = time.time() - t0
        report.check_invalid(trajs, 'RL')  # invalid episodes stay in the batch with weight 0
        if n_groups > cfg['batch_size']:  # dynamic sampling: groups with signal first (one process)
            trajs, sampled_zero_var = keep_groups_with_signal(trajs, cfg['batch_size'], cfg['truncation_penalty'])
        batch = collate(trajs, gym_['fmt'].pad_id, cfg['pack_turns'])  # rows: one per episode, or per turn when folded
        ref_logp = reference_log_probs(ref_model, batch, cfg) if ref_model is not None else None  # [R, T-1]
        # advantages: GRPO per group, plus MemPO's memory advantage on <mem> tokens (advantage.py)
        adv, adv_stats = compute_advantages(model, gym_, cfg, trajs, batch, ref_logp)  # [R, T-1]
        episode_ids = torch.tensor([t.group * cfg['group_size'] + i % cfg['group_size'] for i, t in enumerate(trajs)])
        t_update = time.time()
        m = ppo_update(model, opt, batch, adv, ref_logp, cfg, rng, episode_ids, cfg['batch_size'] * cfg['group_size'],
                       ref_model is not None and is_reference(model, ref_model),
                       scripted and dict(scripted, rng=random.Random(f"sft:{cfg['seed']}:{step}")))
        update_time_s = time.time() - t_update
        peak_gb = peak_memory_gb(cfg['device'])  # this process's peak since the last step's update
        release_memory()  # freed activations back to the system when it runs short: a CPU heap ratchets up
        # log the episodes of every rank, the advantages and the update; evaluate; save
        eps = gather([report.summarise(t) for t in trajs])
        log = dict(step=step, lr=lr, **report.episode_metrics(eps), tokens=sum(e.get('tt', 0) for e in eps),
                   turns_mean=sum(e.get('n_turns', 0) for e in eps) / len(eps),
                   mem_tokens_mean=all_reduce(float(batch['mem_mask'].sum())) / len(eps), peak_memory_gb=peak_gb,
                   **{k: all_reduce(v) / world_size() for k, v in adv_stats.items()}, **m, step_time_s=time.time() - t0,
                   rollout_time_s=rollout_time_s, update_time_s=update_time_s)
        if n_groups > cfg['batch_size']:
            log['zero_var_groups_sampled'] = sampled_zero_var
        log['tokens_per_s'] = log['tokens'] / log['step_time_s']
        if step == cfg['steps'] or (cfg['eval_every'] and step % cfg['eval_every'] == 0):
            t_eval = time.time()
            log.update(evaluate(model, gym_, cfg, step), eval_time_s=time.time() - t_eval)
            if master and cfg['dump_rollouts']:
                report.dump_rollout(report.rollout_path(cfg['out_dir'], step), trajs, batch, adv, cfg, step)
        if master:
            report.log_step(cfg, log, gym_)
        bad_steps = bad_steps + 1 if m['bad_steps'] else 0
        if bad_steps >= cfg['max_bad_steps']:
            print(f'error: stopping at step {step}: {bad_steps} steps in a row had a non-finite loss '
                  f'(max_bad_steps={cfg["max_bad_steps"]})', file=sys.stderr)
            sys.exit(1)
        if step == cfg['steps'] or (cfg['save_every'] and step % cfg['save_every'] == 0):
            save(cfg, step, model, opt, ref_model, gym_, rng, gen)
    if master:
        report.finish_run(cfg, merged(model) if cfg['model'] != 'tiny' else None, gym_['tok'], time.time() - t_start)
    if ddp:  # wait for rank 0's final files: a rank that tears gloo down alone can abort (seen under load)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (OutOfVocabulary, GymContractError) as e:  # a gym's mistake met during RL or an evaluation
        fail(str(e))
    except KeyboardInterrupt:  # one line, not a traceback: what was saved is kept
        print("\ninterrupted: what out_dir holds is kept (checkpoints from the step-0 evaluation on, every save_every "
              "steps); --resume=True continues from the newest, or starts over without one", file=sys.stderr)
        sys.exit(130)
