"""
Train a language-model agent with multi-turn RL: rollout -> rewards -> advantages -> PPO.

    python train.py config/tiny.yaml --steps=50 --seed=2

One training step, top to bottom (see main()):
 1. draw batch_size tasks, repeat each group_size times (one group id per task)
 2. rollout: batched, token-in/token-out, KV cache (rollout.py)
 3. rewards from the gym; MemPO memory rewards P_mem - P_full for turns >= 2 (rollout.py)
 4. advantages: GRPO per group + memory advantage on <mem> tokens (advantage.py)
 5. reference log-probs from the frozen starting policy (when kl_coef > 0)
 6. PPO: ppo_epochs over shuffled mini-batches, clipped surrogate + KL, exact loss normalisation
 7. log one JSON line, evaluate every eval_every steps, checkpoint every save_every steps

Simplifications, on purpose:
1. No value model: GRPO's group baseline replaces it (no GAE, no bootstrapping at truncation;
   truncated episodes get reward 0 and are counted in truncation_rate).
2. The old log-probs are the sampler's own (exact in float32, checked every step as logp_gap_max on
   the first mini-batch, before any update), so no separate old-policy forward pass runs.
3. The warm start is plain cross-entropy on the policy tokens of scripted episodes.
"""

import copy
import difflib
import glob
import json
import math
import os
import random
import sys
import time

import torch
import yaml
from tqdm import tqdm

from advantage import grpo_advantage, memory_advantage, token_advantages
from model import autocast, count_params, load_policy, sequence_log_probs
from rollout import chat_format, check_prompts_fit, collate, memory_rewards, rollout_batch, word_format
import sample  # curves, episode page, run summary (sample.py imports train only inside its main)

# -----------------------------------------------------------------------------
# config: every default in one place; a YAML file overrides it; --key=value overrides the file

config = dict(
    # run
    gym='bugfix',                # bugfix | memory | searchqa | quixbugs
    seed=1337,
    device='cpu',
    dtype='float32',             # float32 | bfloat16 (autocast on CUDA)
    threads=0,                   # torch CPU threads; 0 = torch's default
    out_dir='out',
    resume=False,
    compile=False,               # torch.compile the policy (CUDA)
    # model
    model='tiny',                # tiny | a Hugging Face name or path
    gguf_file='',
    n_layer=2, n_head=4, n_embd=128, max_len=256,
    grad_checkpointing=False,
    enable_thinking=False,       # chat templates with a thinking switch (Qwen3)
    require_think=False,         # SearchQA: every turn needs <think> (always when enable_thinking)
    # rollout
    max_turns=12,
    max_response_tokens=6,       # tokens the policy may write in one turn, its stop token included
    temperature=1.0,
    keep_tool_results='all',     # 'all' = full history; an int k = MemPO folding (prompt + last <mem> + last k results)
    # gym data and sizes
    data='',                     # searchqa: hotpotqa | bamboogle | a JSONL path of {id, question, answers}
    prompt_style='train',        # searchqa: 'train' (bare question) | 'eval' (format instructions)
    max_obs_tokens=400,          # searchqa: tokens of search results per observation
    train_tasks=0,               # 0 = the gym's default
    train_variants=24,           # bugfix: variants per training function (names, constants, which op broke it)
    train_generated=0,           # bugfix: random training functions from a grammar, added to the 22 templates
    eval_tasks=0,                # 0 = all of the gym's held-out tasks (memory: 96)
    eval_samples=4,              # sampled episodes per held-out task at each evaluation
    # warm start (SFT on scripted episodes)
    warmstart_episodes=512,
    warmstart_steps=200,
    warmstart_lr=3e-3,
    warmstart_batch_size=32,     # episodes per step, with all their rows (folding: one row per turn)
    # RL
    steps=100,
    batch_size=8,                # tasks per step
    group_size=8,                # rollouts per task
    lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.99,
    warmup_steps=5,
    grad_clip=1.0,
    ppo_epochs=1,
    mini_batches=2,              # mini-batches per epoch (each an optimizer step)
    clip_low=0.2, clip_high=0.28,
    kl_coef=0.0,
    kl_type='k3',                # k1 | k2 | k3
    loss_agg='token-mean',       # token-mean | seq-mean | drgrpo
    adv_std=True,                # divide by the group std (False: Dr.GRPO's r - mean)
    adv_eps=1e-6,
    mem_coef=0.0,                # weight of MemPO's memory advantage on <mem> tokens
    max_tokens_per_microbatch=16384,
    max_bad_steps=3,
    # logging
    eval_every=25,
    save_every=25,
    keep_checkpoints=2,
    tensorboard=False,           # mirror metrics.jsonl to TensorBoard (out_dir/tb) if tensorboard is installed
    wandb_project='',            # mirror metrics.jsonl to this Weights & Biases project if wandb is installed
    dump_rollouts=False,         # at each eval step save the training batch (+ advantages) for sample.py
)
TYPES = {'keep_tool_results': (str, int)}  # keys whose values may take more than one type
TRUNCATED = ('truncated', 'budget', 'max_turns')  # stop reasons of an episode that ran out of turns or context


def fail(msg):
    print(f'error: {msg}', file=sys.stderr)
    sys.exit(2)


def parse_value(key, raw, default):
    """Parse --key=value by the default's type; bools accept true/false/1/0."""
    if isinstance(default, bool):
        if raw.lower() in ('true', '1', 'yes'):
            return True
        if raw.lower() in ('false', '0', 'no'):
            return False
        fail(f'--{key}={raw}: expected true or false')
    try:
        return yaml.safe_load(raw) if not isinstance(default, str) else raw
    except yaml.YAMLError:
        fail(f'--{key}={raw}: cannot parse the value')


def check_key(key, value, cfg):
    if key not in cfg:
        close = difflib.get_close_matches(key, list(cfg), n=1) or [
            k for k in cfg if key.startswith(k + '_') or k.startswith(key + '_')][:1]  # lr_rate -> lr
        fail(f"unknown config key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ''))
    default = cfg[key]
    ok_types = TYPES.get(key, (type(default),))
    if isinstance(value, bool) and bool not in ok_types:
        ok = False
    elif float in ok_types and isinstance(value, int):
        ok = True
    else:
        ok = isinstance(value, ok_types)
    if not ok:
        fail(f"config key '{key}' expects {' or '.join(t.__name__ for t in ok_types)}, got {value!r}")
    return float(value) if float in ok_types and not isinstance(value, bool) else value


def load_config(argv, defaults=config):
    """defaults <- YAML files <- --key=value, in order; every value type-checked against the default.
    Any error exits with status 2 and one line naming the key or file."""
    cfg = dict(defaults)
    for arg in argv:
        if arg in ('-h', '--help'):
            print((sys.modules['__main__'].__doc__ or '').strip())
            print('\nconfig keys (YAML files, then --key=value): ' + ' '.join(cfg))
            sys.exit(0)
        if arg.startswith('--'):
            key, eq, raw = arg[2:].partition('=')
            if not eq:
                fail(f"'{arg}': write --key=value")
            if key not in cfg:
                check_key(key, None, cfg)
            cfg[key] = check_key(key, parse_value(key, raw, cfg[key]), cfg)
        else:
            if not os.path.isfile(arg):
                fail(f'config file is a directory: {arg}' if os.path.isdir(arg) else f'config file not found: {arg}')
            try:
                with open(arg) as f:
                    loaded = yaml.safe_load(f) or {}
            except UnicodeDecodeError:
                fail(f'cannot read YAML file {arg}: not UTF-8 text')
            except yaml.YAMLError as e:
                mark = getattr(e, 'problem_mark', None)
                where = f':{mark.line + 1}:{mark.column + 1}' if mark else ''
                fail(f'cannot parse YAML file {arg}{where}: {getattr(e, "problem", None) or str(e).splitlines()[0]}')
            if not isinstance(loaded, dict):
                fail(f'config file {arg} must hold a mapping of keys to values')
            for key, value in loaded.items():
                cfg[key] = check_key(key, value, cfg)
    ktr = cfg['keep_tool_results']
    if not (ktr == 'all' or (str(ktr).isdigit() and int(ktr) >= 1)):  # 3, '3'; not 0, -1, 'some'
        fail(f"config key 'keep_tool_results' expects 'all' or an integer >= 1, got {ktr!r}")
    cfg['keep_tool_results'] = ktr if ktr == 'all' else int(ktr)
    for key in ('steps', 'batch_size', 'group_size', 'mini_batches', 'ppo_epochs', 'max_turns', 'max_response_tokens',
                'max_len', 'n_layer', 'n_head', 'n_embd', 'eval_samples', 'warmstart_batch_size', 'keep_checkpoints',
                'max_tokens_per_microbatch', 'max_bad_steps', 'train_variants'):
        if cfg[key] < 1:
            fail(f"config key '{key}' must be >= 1, got {cfg[key]!r}")
    for key in ('threads', 'eval_every', 'save_every', 'warmstart_steps', 'warmstart_episodes', 'train_tasks',
                'train_generated', 'eval_tasks', 'warmup_steps', 'kl_coef', 'mem_coef', 'lr', 'warmstart_lr'):
        if cfg[key] < 0:
            fail(f"config key '{key}' must be >= 0, got {cfg[key]!r}")
    if cfg['model'] == 'tiny' and cfg['n_embd'] % cfg['n_head']:
        fail(f"config key 'n_head' ({cfg['n_head']}) must divide n_embd ({cfg['n_embd']})")
    if cfg['threads'] > (os.cpu_count() or 1):
        fail(f"config key 'threads' ({cfg['threads']}) is more than this machine's {os.cpu_count()} cores")
    if cfg['max_len'] < cfg['max_response_tokens'] + 16:
        fail(f"config key 'max_len' ({cfg['max_len']}) leaves no room for a prompt and a response of "
             f"max_response_tokens={cfg['max_response_tokens']}")
    if cfg['temperature'] <= 0:
        fail(f"config key 'temperature' must be > 0 for training (evaluation also runs greedy), got {cfg['temperature']!r}")
    if cfg['gym'] not in ('bugfix', 'memory', 'searchqa', 'quixbugs'):
        fail(f"unknown gym {cfg['gym']!r} (bugfix, memory, searchqa, quixbugs)")
    if cfg['mem_coef'] > 0 and cfg['gym'] not in ('memory', 'searchqa'):
        fail(f"config key 'mem_coef' ({cfg['mem_coef']}) needs a gym whose turns write <mem> "
             f"(memory, searchqa), not {cfg['gym']!r}")
    try:
        dev = torch.device(cfg['device'])
    except RuntimeError:
        fail(f"config key 'device': unknown device {cfg['device']!r} (cpu, cuda, cuda:N)")
    if dev.type not in ('cpu', 'cuda'):
        fail(f"config key 'device': {cfg['device']!r} is not supported (cpu, cuda, cuda:N)")
    for key, allowed in [('kl_type', ('k1', 'k2', 'k3')), ('loss_agg', ('token-mean', 'seq-mean', 'drgrpo')),
                         ('dtype', ('float32', 'bfloat16'))]:
        if cfg[key] not in allowed:
            fail(f"config key '{key}' must be one of {', '.join(allowed)}, got {cfg[key]!r}")
    return cfg


# -----------------------------------------------------------------------------
# gyms: what train.py needs from each


def setup_gym(cfg):
    """What train.py needs from a gym, as a dict: tok, fmt, train_tasks, eval_tasks, make_env() -> env,
    warm_policy(rng) -> scripted text policy (None: no warm start), baselines {name: exact held-out
    success}, answer_text(task) -> gold answer as the policy writes it (memory gyms)."""
    name = cfg['gym']
    if name == 'bugfix':
        import gym
        train_tasks = gym.make_tasks('train', n_variants=cfg['train_variants'], n_generated=cfg['train_generated'])
        eval_tasks = gym.make_tasks('heldout')
        tok = gym.build_tokenizer(gym.bugfix_texts(train_tasks + eval_tasks))
        eval_tasks = eval_tasks[:cfg['eval_tasks'] or len(eval_tasks)]
        return dict(tok=tok, fmt=word_format(tok), train_tasks=train_tasks, eval_tasks=eval_tasks,
                    make_env=lambda: gym.BugFixEnv(cfg['max_turns']),
                    baselines={k: v for k, v in gym.reference_baselines(eval_tasks, cfg['max_turns']).items()
                               if k in ('random_calls', 'any_edit')},
                    warm_policy=lambda rng: episode_policy(gym.scripted_policy('warmstart', rng.randrange(1 << 30))))
    if name == 'memory':
        import gym
        import gym_memory as gm
        train_tasks = gm.make_tasks('train', cfg['train_tasks'] or 2000, seed=cfg['seed'])
        eval_tasks = gm.make_tasks('heldout', cfg['eval_tasks'] or 96, seed=cfg['seed'])
        tok = gym.build_tokenizer(gm.memory_texts())
        return dict(tok=tok, fmt=word_format(tok, memory=True), train_tasks=train_tasks, eval_tasks=eval_tasks,
                    make_env=gm.MemoryEnv, baselines={}, answer_text=gm.gold_answer_text,
                    warm_policy=lambda rng: folded_policy(gm.oracle_policy))
    if cfg['model'] == 'tiny':
        fail(f"gym '{name}' needs a Hugging Face model (model: tiny-qwen3, smollm2 or a name/path)")
    import hf
    if name == 'searchqa':
        import gym_search as gs
        train_tasks = gs.make_tasks('train', cfg['seed'], source=cfg['data'] or 'hotpotqa')  # bad data fails here, first
        eval_tasks = gs.make_tasks('heldout', cfg['seed'], source=cfg['data'] or 'hotpotqa')
        tok = hf.load_tokenizer(cfg['model'])
        stable, detail = hf.check_prefix_stability(tok, enable_thinking=cfg['enable_thinking'])
        if not stable and rank() == 0:  # we never re-render: every turn trains in the context it was sampled in
            print(f'chat template rewrites history ({detail}); contexts are kept per turn as sampled')
        n_train, n_eval = cfg['train_tasks'] or len(train_tasks), cfg['eval_tasks'] or len(eval_tasks)
        return dict(tok=tok, fmt=chat_format(tok, enable_thinking=cfg['enable_thinking'], memory=True),
                    train_tasks=train_tasks[:n_train], eval_tasks=eval_tasks[:n_eval],
                    make_env=lambda: gs.SearchQAEnv(tok, max_turns=cfg['max_turns'], max_obs_tokens=cfg['max_obs_tokens'],
                                                    require_think=cfg['enable_thinking'] or cfg['require_think'],
                                                    prompt_style=cfg['prompt_style']),
                    baselines={}, warm_policy=None,
                    answer_text=lambda task: '<answer>' + '; '.join(g[0] for g in task.golds) + '</answer>')
    if name == 'quixbugs':
        import gym_quixbugs as gq
        tok = hf.load_tokenizer(cfg['model'])
        eval_tasks = gq.make_tasks('heldout')
        return dict(tok=tok, fmt=chat_format(tok, tools=gq.tool_schemas(), enable_thinking=cfg['enable_thinking']),
                    train_tasks=gq.make_tasks('train'), eval_tasks=eval_tasks[:cfg['eval_tasks'] or len(eval_tasks)],
                    make_env=lambda: gq.QuixBugsEnv(max_turns=cfg['max_turns']), baselines={}, warm_policy=None)
    fail(f"unknown gym '{name}' (bugfix, memory, searchqa, quixbugs)")


def episode_policy(policy):
    """Adapt a text policy over the list of observations (prompt first) to rollout's (episode) -> text."""
    return lambda ep: policy(ep.texts)


def folded_policy(policy):
    """Adapt a memory policy (question, last mem, last obs) -> text to rollout's (episode) -> text."""
    import gym_memory as gm

    def act(ep):
        mem = gm.extract_mem('<mem> ' + ep.actions[-1]) if ep.actions else None
        return policy(ep.texts[0], mem, ep.texts[-1] if ep.actions else None)
    return act


# -----------------------------------------------------------------------------
# PPO maths


def kl_penalty(logp, ref_logp, kl_type):
    """Per-token KL estimate of the policy from the reference (Schulman 2020, "Approximating KL
    divergence"): k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 with log r = logp - ref.
    The log-ratio is clamped to [-20, 20] so k3 cannot overflow."""
    log_ratio = (logp - ref_logp).clamp(-20, 20)
    if kl_type == 'k1':
        return log_ratio
    if kl_type == 'k2':
        return 0.5 * log_ratio ** 2
    return torch.exp(-log_ratio) + log_ratio - 1


def loss_weights(action_mask, row_episode, loss_agg, n_episodes, max_episode_tokens, n_tokens=None):
    """Per-token weights [R, T-1] whose weighted sum is the mini-batch loss. Computed once per
    mini-batch, before it is split into micro-batches, so the gradient cannot depend on the split.
    token-mean: 1 / (policy tokens in the mini-batch, n_tokens: all ranks'); seq-mean: 1 / (policy
    tokens of the token's episode x episodes); drgrpo: 1 / (max_episode_tokens x episodes), Dr.GRPO's
    constant normaliser (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1)."""
    if loss_agg == 'token-mean':
        n_tokens = float(action_mask.sum()) if n_tokens is None else n_tokens
        return action_mask / max(n_tokens, 1.0)
    if loss_agg == 'seq-mean':
        per_ep = torch.zeros(int(row_episode.max()) + 1).index_add_(0, row_episode, action_mask.sum(1))
        return action_mask / (per_ep[row_episode].clamp(min=1)[:, None] * n_episodes)
    return action_mask / (max_episode_tokens * n_episodes)


def micro_batches(lengths, budget):
    """Split row indices into micro-batches of at most `budget` padded tokens, sorted by length so
    rows of similar length share a batch (less padding). Returns a list of index lists."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur, longest = [], [], 0
    for i in order:
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    return out + [cur] if cur else out


# -----------------------------------------------------------------------------
# the pieces of one step


def rollout_step(model, gym_, cfg, tasks, gen, temperature=None, group_ids=None):
    """Episodes for `tasks`, each repeated group_size times; group id = group_ids[i] (default i)."""
    group_ids = group_ids if group_ids is not None else range(len(tasks))
    reps = [(g, t) for g, t in zip(group_ids, tasks) for _ in range(cfg['group_size'])]
    envs = [gym_['make_env']() for _ in reps]
    model.eval()
    return rollout_batch(model, gym_['fmt'], envs, [t for _, t in reps], cfg, groups=[g for g, _ in reps],
                         generator=gen, temperature=temperature)


def compute_advantages(model, gym_, cfg, trajs, batch):
    """Outcome advantage per episode, plus MemPO's memory advantage on <mem> tokens. [R, T-1]."""
    out = grpo_advantage(batch['rewards'], batch['group_ids'], batch['valid'], cfg['adv_std'], cfg['adv_eps'])
    stats = {}
    mem_adv = None
    if cfg['mem_coef'] and 'answer_text' in gym_:
        answers = [gym_['answer_text'](t.task) for t in trajs]
        mem_r, turn_valid = memory_rewards(model, trajs, gym_['fmt'], answers, cfg)
        mem_adv = memory_advantage(mem_r, turn_valid, batch['group_ids'], cfg['adv_eps'])
        n = turn_valid.sum().clamp(min=1)
        stats = dict(mem_reward_mean=float((mem_r * turn_valid).sum() / n),
                     mem_adv_abs_mean=float((mem_adv.abs() * turn_valid).sum() / n))
    adv = token_advantages(out, batch['row_episode'], batch['action_mask'], mem_adv, batch['mem_mask'],
                           batch['turn_ids'], cfg['mem_coef'])
    return adv, stats


@torch.no_grad()
def reference_log_probs(ref_model, batch, cfg):
    """Log-probs [R, T-1] of the frozen reference, in token-budget micro-batches."""
    out = torch.zeros_like(batch['sample_logp'])
    lengths = batch['attention_mask'].sum(1).tolist()
    for mb in micro_batches(lengths, cfg['max_tokens_per_microbatch']):
        L = max(lengths[i] for i in mb)
        out[mb, :L - 1] = sequence_log_probs(ref_model, batch['ids'][mb, :L].to(cfg['device']),
                                             batch['attention_mask'][mb, :L].to(cfg['device']),
                                             cfg['temperature']).float().cpu()
    return out


def ppo_update(model, opt, batch, adv, ref_logp, cfg, rng, episode_ids=None, n_global=None):
    """ppo_epochs passes over shuffled mini-batches of episodes; one optimizer step per mini-batch.

    batch: collate() of this process's episodes; adv [R, T-1]; ref_logp [R, T-1] or None.
    Data parallel (torchrun): each rank holds whole groups; episode_ids [N] are their indices in the
    global batch of n_global episodes. Every rank shuffles the global indices with the same rng, so
    all ranks agree on each mini-batch; loss normalisers are global and gradients are summed across
    ranks, so N ranks compute exactly the update of one process on the global batch.
    A non-finite loss or gradient skips that optimizer step (counted in bad_steps). Returns metrics."""
    dev = cfg['device']
    n_local = len(batch['rewards'])
    episode_ids = torch.arange(n_local) if episode_ids is None else episode_ids
    n_global = n_global or n_local
    mask = batch['action_mask'] * batch['valid'][batch['row_episode']][:, None]  # invalid episodes weigh 0
    row_global = episode_ids[batch['row_episode']]  # [R]
    lengths = batch['attention_mask'].sum(1).tolist()
    max_ep_tokens = cfg['max_turns'] * cfg['max_response_tokens']
    sums = dict(clip_frac=0.0, kl=0.0, entropy=0.0, tokens=0.0, loss=0.0)
    m = dict(grad_norm=0.0, logp_gap_max=0.0, ratio_dev_first_minibatch=0.0, bad_steps=0)
    first = True
    model.train()
    for epoch in range(cfg['ppo_epochs']):
        order = list(range(n_global))
        rng.shuffle(order)
        for mb_eps in [order[i::cfg['mini_batches']] for i in range(cfg['mini_batches'])]:
            rows = torch.nonzero(torch.isin(row_global, torch.tensor(mb_eps))).squeeze(1)
            n_tokens = all_reduce(float(mask[rows].sum()))
            w = loss_weights(mask[rows], batch['row_episode'][rows], cfg['loss_agg'], len(mb_eps), max_ep_tokens,
                             n_tokens)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for mb in micro_batches([lengths[i] for i in rows.tolist()], cfg['max_tokens_per_microbatch']):
                r = rows[mb]
                L = max(lengths[i] for i in r.tolist())
                ids, attn = batch['ids'][r, :L].to(dev), batch['attention_mask'][r, :L].to(dev)
                am, old = mask[r, :L - 1].to(dev), batch['sample_logp'][r, :L - 1].to(dev)
                a, wt = adv[r, :L - 1].to(dev), w[mb, :L - 1].to(dev)
                with autocast(cfg):
                    logp, ent = sequence_log_probs(model, ids, attn, cfg['temperature'], with_entropy=True, positions=am)
                ratio = torch.exp(logp - old)  # [b, L-1]; old = the sampler's log-probs, no gradient
                surr = torch.min(ratio * a, ratio.clamp(1 - cfg['clip_low'], 1 + cfg['clip_high']) * a)
                loss_tok = -surr
                if ref_logp is not None:
                    kl = kl_penalty(logp, ref_logp[r, :L - 1].to(dev), cfg['kl_type'])
                    loss_tok = loss_tok + cfg['kl_coef'] * kl
                    sums['kl'] += float((kl.detach() * am).sum())
                loss = (loss_tok * wt).sum()
                loss.backward()
                total += loss.item()
                with torch.no_grad():
                    pol = am.bool()
                    clipped = ((ratio < 1 - cfg['clip_low']) & (a < 0)) | ((ratio > 1 + cfg['clip_high']) & (a > 0))
                    sums['clip_frac'] += float((clipped & pol).sum())
                    sums['entropy'] += float((ent * am).sum())
                    sums['tokens'] += float(am.sum())
                    if first and pol.any():  # before any optimizer step: the sampler's log-probs must match
                        m['logp_gap_max'] = max(m['logp_gap_max'], float((logp - old).abs()[pol].max()))
                        m['ratio_dev_first_minibatch'] = max(m['ratio_dev_first_minibatch'],
                                                             float((ratio - 1).abs()[pol].max()))
            first = False
            total = all_reduce(total)
            sync_gradients(model)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip']))
            if not (math.isfinite(total) and math.isfinite(grad_norm)):
                m['bad_steps'] += 1  # a non-finite loss never reaches the weights
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            sums['loss'] += total / (cfg['ppo_epochs'] * cfg['mini_batches'])
            m['grad_norm'] = max(m['grad_norm'], grad_norm)
    sums = {k: all_reduce(v) for k, v in sums.items()}
    m['loss'] = sums['loss'] / world_size()
    for k in ('clip_frac', 'kl', 'entropy'):  # means over the policy tokens of all updates
        m[k] = sums[k] / max(sums['tokens'], 1.0)
    m['logp_gap_max'] = all_reduce(m['logp_gap_max'], 'max')
    m['ratio_dev_first_minibatch'] = all_reduce(m['ratio_dev_first_minibatch'], 'max')
    if ref_logp is None:
        m['kl'] = None
    return m


# -----------------------------------------------------------------------------
# data parallel helpers (torchrun); single-process runs pass through


def world_size():
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def all_reduce(x, op='sum'):
    """Sum (or max) a Python float over ranks."""
    if world_size() == 1:
        return x
    t = torch.tensor([float(x)], dtype=torch.float64)
    torch.distributed.all_reduce(t, torch.distributed.ReduceOp.SUM if op == 'sum' else torch.distributed.ReduceOp.MAX)
    return float(t)


def sync_gradients(model):
    """Sum gradients over ranks: each rank's loss already carries the global normaliser."""
    if world_size() == 1:
        return
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a rank with no rows in this mini-batch still takes part
            torch.distributed.all_reduce(p.grad)


def gather(items):
    """Concatenate a list from every rank (rank order)."""
    if world_size() == 1:
        return items
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, items)
    return [x for part in out for x in part]


# -----------------------------------------------------------------------------
# evaluation and warm start


def summarise(t):
    """The numbers of one episode that metrics need (small, so ranks can exchange them)."""
    keys = ('em', 'f1', 'k', 'tt', 'pt', 'n_turns')
    return dict(reward=t.reward, success=bool(t.info.get('success')), stop=t.info.get('stop'), valid=t.valid,
                **{k: t.info[k] for k in keys if k in t.info})


def episode_metrics(eps, prefix=''):
    """Means over episode summaries; memory gyms add EM/F1/TT/PT overall and per objective count k."""
    n = max(len(eps), 1)
    out = {f'{prefix}reward_mean': sum(e['reward'] for e in eps) / n,
           f'{prefix}success_rate': sum(e['success'] for e in eps) / n,
           f'{prefix}truncation_rate': sum(e['stop'] in TRUNCATED for e in eps) / n,  # out of turns or context
           f'{prefix}tt': sum(e.get('tt', 0) for e in eps) / n,  # tokens processed per episode
           f'{prefix}pt': sum(e.get('pt', 0) for e in eps) / n}  # mean over episodes of the peak context
    if eps and 'em' in eps[0]:
        by_k = {}
        for e in eps:
            by_k.setdefault(e.get('k', 1), []).append(e)
        for suffix, es in [('', eps)] + [(f'_k{k}', v) for k, v in sorted(by_k.items())]:
            for key in ('em', 'f1', 'tt', 'pt'):
                out[f'{prefix}{key}{suffix}'] = sum(float(e.get(key, 0.0)) for e in es) / len(es)
    return out


@torch.no_grad()
def evaluate(model, gym_, cfg, step):
    """Held-out success, greedy (one episode per task) and sampled (eval_samples per task); the tasks
    are sharded over ranks and the episode summaries gathered. Sampling uses its own generator, seeded
    by the step, so evaluating never shifts the training run's random streams."""
    tasks = gym_['eval_tasks'][rank()::world_size()]
    gen = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'] * 7919 + step * 104729 + rank())
    out = {}
    for name, temp, reps in [('greedy', 0.0, 1), ('sampled', cfg['temperature'], cfg['eval_samples'])]:
        trajs = rollout_step(model, gym_, dict(cfg, group_size=reps), tasks, gen, temperature=temp) if tasks else []
        eps = gather([summarise(t) for t in trajs])
        out[f'eval_{name}_success'] = episode_metrics(eps)['success_rate']
        if name == 'sampled':
            out.update(episode_metrics(eps, 'eval_'))
    return out


def episode_rows(row_episode, n_episodes):
    """row_episode [R] (collate's episode index of each row) -> list of n_episodes lists of row indices."""
    rows = [[] for _ in range(n_episodes)]
    for r, e in enumerate(row_episode.tolist()):
        rows[e].append(r)
    return rows


def warm_start(model, gym_, cfg, rng):
    """Cross-entropy on the policy tokens of scripted episodes (tool and template tokens excluded).
    Each step draws warmstart_batch_size episodes with all their rows, so folded and full-history
    agents imitate the same number of turns per step. Returns the mean loss of the last 10 steps
    (nats per policy token), or None when there is no warm start."""
    n = cfg['warmstart_episodes']
    if n == 0 or cfg['warmstart_steps'] == 0 or gym_['warm_policy'] is None:
        return None
    tasks = [rng.choice(gym_['train_tasks']) for _ in range(n)]
    policies = [gym_['warm_policy'](rng) for _ in range(n)]
    trajs = rollout_batch(policies, gym_['fmt'], [gym_['make_env']() for _ in tasks], tasks, cfg)
    batch = collate(trajs, gym_['fmt'].pad_id)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['warmstart_lr'], weight_decay=0.0)
    model.train()
    rows_of = episode_rows(batch['row_episode'], len(trajs))  # a step draws episodes, not rows (docstring)
    losses = []
    for it in range(cfg['warmstart_steps']):
        # 30-step ramp, then cosine decay to 10%: the scripted targets are deterministic, and at a
        # constant lr the loss stays noisy (memory gym: 0.17 vs 0.08; step-0 EM at k=2 0.32 vs 0.69)
        frac = it / cfg['warmstart_steps']
        for g in opt.param_groups:
            g['lr'] = cfg['warmstart_lr'] * min(1.0, (it + 1) / 30) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        idx = torch.tensor([r for _ in range(cfg['warmstart_batch_size']) for r in rows_of[rng.randrange(n)]])
        L = int(batch['attention_mask'][idx].sum(1).max())
        am = batch['action_mask'][idx, :L - 1].to(cfg['device'])
        logp = sequence_log_probs(model, batch['ids'][idx, :L].to(cfg['device']),
                                  batch['attention_mask'][idx, :L].to(cfg['device']))
        loss = -(logp * am).sum() / am.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        opt.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / len(losses[-10:])


# -----------------------------------------------------------------------------
# checkpoints


def save_checkpoint(state, out_dir, step, keep):
    """Write ckpt_<step>.pt atomically (temporary file, then rename) and keep the newest `keep`."""
    path = os.path.join(out_dir, f'ckpt_{step:06d}.pt')
    tmp = path + '.tmp'
    torch.save(state, tmp)
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    for old in sorted(glob.glob(os.path.join(out_dir, 'ckpt_*.pt')))[:-keep]:
        os.remove(old)
    return path


def load_latest_checkpoint(out_dir):
    """The newest checkpoint in out_dir that loads; a corrupt one is reported and skipped.
    Returns (state, path) or (None, None) when there is none."""
    for path in sorted(glob.glob(os.path.join(out_dir, 'ckpt_*.pt')), reverse=True):
        try:
            state = torch.load(path, map_location='cpu', weights_only=False)
            if not isinstance(state, dict) or 'model' not in state:
                raise ValueError('not a nanoagent checkpoint')
            return state, path
        except Exception as e:
            print(f'checkpoint {path} is corrupt ({type(e).__name__}); trying the previous one', file=sys.stderr)
    return None, None


def set_rng_state(state, rng, gen):
    """Restore the task-drawing rng, torch's global rng and this rank's sampling generator."""
    rng.setstate(state['python'])
    torch.set_rng_state(state['torch'])
    gen.set_state(state['gen'][min(rank(), len(state['gen']) - 1)])


# -----------------------------------------------------------------------------


def main(argv):
    t_start = time.time()
    cfg = load_config(argv)
    if cfg['device'].startswith('cuda') and not torch.cuda.is_available():
        fail(f"config key 'device' is {cfg['device']!r} but torch sees no CUDA device (use --device=cpu)")
    ddp = int(os.environ.get('WORLD_SIZE', '1')) > 1
    if ddp:  # torchrun: one process per device, gloo on CPU, nccl on CUDA
        torch.distributed.init_process_group('nccl' if cfg['device'].startswith('cuda') else 'gloo')
        if cfg['device'].startswith('cuda'):
            cfg['device'] = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(cfg['device'])
    master = rank() == 0
    if master:
        print(json.dumps(cfg))
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    try:
        os.makedirs(cfg['out_dir'], exist_ok=True)
    except OSError as e:
        fail(f"cannot create out_dir {cfg['out_dir']!r}: {e.strerror}")
    random.seed(cfg['seed'])
    torch.manual_seed(cfg['seed'])
    rng = random.Random(cfg['seed'])  # the same on every rank: all ranks draw the same tasks
    gen = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'] + rank())  # sampling differs per rank

    try:  # bad data stops the run here, in one line, before any training
        gym_ = setup_gym(cfg)
        check_prompts_fit(gym_, cfg)
    except (OSError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if not gym_['train_tasks'] or not gym_['eval_tasks']:
        fail(f"gym '{cfg['gym']}' has an empty {'train' if not gym_['train_tasks'] else 'held-out'} split")
    try:
        model = load_policy(cfg, gym_['tok'].vocab_size)
    except OSError as e:
        fail(str(e))
    if master:
        print(f"policy: {cfg['model']}, {count_params(model) / 1e6:.2f}M parameters, gym {cfg['gym']}: "
              f"{len(gym_['train_tasks'])} train / {len(gym_['eval_tasks'])} held-out tasks, {world_size()} process(es)")
    metrics_path = os.path.join(cfg['out_dir'], 'metrics.jsonl')
    state, ckpt_path = load_latest_checkpoint(cfg['out_dir']) if cfg['resume'] else (None, None)
    if cfg['resume'] and state is None:
        if glob.glob(os.path.join(cfg['out_dir'], 'ckpt_*.pt')):  # never delete what could not be read
            fail(f"--resume=True: no checkpoint in {cfg['out_dir']} loads (all corrupt, see above); "
                 f"move them away or run without --resume")
        if master:
            print(f"no checkpoint in {cfg['out_dir']}: starting from scratch")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']),
                            weight_decay=cfg['weight_decay'])
    ref_model = None
    if state is None:
        stale = sorted(glob.glob(os.path.join(cfg['out_dir'], 'ckpt_*.pt')))
        if stale and master:  # a fresh run owns its out_dir: an old checkpoint would be resumed by mistake
            print(f"fresh run: removing {len(stale)} checkpoint(s) of an earlier run in {cfg['out_dir']} (--resume=True keeps them)")
            for path in stale:
                os.remove(path)
        t0 = time.time()
        sft_loss = warm_start(model, gym_, cfg, rng)  # identical on every rank (same seed, same data)
        if sft_loss is not None and master:
            print(f'warm start: {cfg["warmstart_steps"]} steps, final loss {sft_loss:.3f}, {time.time() - t0:.0f}s')
        if cfg['kl_coef']:
            ref_model = copy.deepcopy(model).eval()
        start = 0
        log0 = dict(step=0, **evaluate(model, gym_, cfg, 0), **{f'eval_baseline_{k}': v for k, v in gym_['baselines'].items()})
        if master:  # step 0: the warm-started policy, before any RL
            with open(metrics_path, 'w') as f:
                f.write(json.dumps(log0) + '\n')
            sample.log_external(cfg, log0, 0)
    else:
        try:
            model.load_state_dict(state['model'])
            opt.load_state_dict(state['optimizer'])
        except (RuntimeError, ValueError, KeyError) as e:
            fail(f'{ckpt_path} does not fit this config (was the model changed?): {str(e).splitlines()[0]}')
        if cfg['kl_coef']:
            ref_model = copy.deepcopy(model).eval()
            ref_model.load_state_dict(state['ref_model'])
        set_rng_state(state['rng'], rng, gen)
        start = state['step']
        if master:  # metrics logged after the checkpoint belong to steps that will run again
            lines = [json.dumps(r) + '\n' for r in sample.read_metrics(metrics_path) if r['step'] <= start] \
                if os.path.exists(metrics_path) else []  # read_metrics skips a line torn by a kill
            open(metrics_path, 'w').writelines(lines)
            print(f'resumed from {ckpt_path} at step {start}')
    if master:
        json.dump(cfg, open(os.path.join(cfg['out_dir'], 'config.json'), 'w'), indent=1)
        metrics_file = open(metrics_path, 'a')

    bad_steps = 0
    for step in tqdm(range(start + 1, cfg['steps'] + 1), initial=start, total=cfg['steps'], disable=not master or None):
        t0 = time.time()
        lr = cfg['lr'] * min(1.0, step / max(1, cfg['warmup_steps']))  # linear warm-up, then constant
        for g in opt.param_groups:
            g['lr'] = lr
        # 1-2. tasks (the same draw on every rank), this rank's groups, rollout
        tasks = [rng.choice(gym_['train_tasks']) for _ in range(cfg['batch_size'])]
        mine = list(range(rank(), cfg['batch_size'], world_size()))  # a group never straddles ranks
        trajs = rollout_step(model, gym_, cfg, [tasks[g] for g in mine], gen, group_ids=mine)
        batch = collate(trajs, gym_['fmt'].pad_id)
        # 3-4. rewards -> advantages (outcome per group, memory on <mem> tokens)
        adv, mem_stats = compute_advantages(model, gym_, cfg, trajs, batch)
        if not torch.isfinite(adv).all():
            raise FloatingPointError(f'step {step}: non-finite advantages')
        # 5. reference log-probs
        ref_logp = reference_log_probs(ref_model, batch, cfg) if ref_model is not None else None
        # 6. PPO
        episode_ids = torch.tensor([t.group * cfg['group_size'] + i % cfg['group_size'] for i, t in enumerate(trajs)])
        m = ppo_update(model, opt, batch, adv, ref_logp, cfg, rng, episode_ids, cfg['batch_size'] * cfg['group_size'])
        # 7. log, evaluate, checkpoint
        eps = gather([summarise(t) for t in trajs])
        log = dict(step=step, lr=lr, **episode_metrics(eps), invalid_episodes=sum(not e['valid'] for e in eps),
                   tokens=sum(e.get('tt', 0) for e in eps),
                   turns_mean=sum(e.get('n_turns', 0) for e in eps) / len(eps),
                   mem_tokens_mean=all_reduce(float(batch['mem_mask'].sum())) / len(eps),
                   **{k: all_reduce(v) / world_size() for k, v in mem_stats.items()}, **m)
        bad_steps = bad_steps + 1 if m['bad_steps'] else 0
        dt = time.time() - t0
        log.update(step_time_s=dt, tokens_per_s=sum(e.get('tt', 0) for e in eps) / dt)
        if step == cfg['steps'] or (cfg['eval_every'] and step % cfg['eval_every'] == 0):
            log.update(evaluate(model, gym_, cfg, step))
            log.update({f'eval_baseline_{k}': v for k, v in gym_['baselines'].items()})
            if master:
                tqdm.write(f"step {step}: train success {log['success_rate']:.3f}, held-out success {log['eval_success_rate']:.3f} "
                           f"(greedy {log['eval_greedy_success']:.3f})"
                           + ''.join(f', {k} {v:.3f}' for k, v in gym_['baselines'].items()))
        if master:
            metrics_file.write(json.dumps(log) + '\n')
            metrics_file.flush()
            sample.log_external(cfg, log, step)
            if 'eval_success_rate' in log:  # an eval step: redraw the curves
                sample.plot_metrics(metrics_path, os.path.join(cfg['out_dir'], sample.CURVES))
                if cfg['dump_rollouts']:
                    sample.dump_rollout(os.path.join(cfg['out_dir'], f'rollout_{step:06d}.pt'), trajs, batch, adv, cfg, step)
        if bad_steps >= cfg['max_bad_steps']:
            if master:
                print(f'stopping at step {step}: {bad_steps} steps in a row had a non-finite loss '
                      f'(max_bad_steps={cfg["max_bad_steps"]})', file=sys.stderr)
            sys.exit(1)
        if step == cfg['steps'] or (cfg['save_every'] and step % cfg['save_every'] == 0):
            gens = gather([gen.get_state()])
            if master:
                save_checkpoint(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step, config=cfg,
                                     rng=dict(python=rng.getstate(), torch=torch.get_rng_state(), gen=gens),
                                     ref_model=ref_model.state_dict() if ref_model is not None else None),
                                cfg['out_dir'], step, cfg['keep_checkpoints'])
    if master and cfg['model'] != 'tiny':  # a trained HF policy that transformers or vLLM can load and serve
        model.save_pretrained(os.path.join(cfg['out_dir'], 'hf'), safe_serialization=True)
        gym_['tok'].save_pretrained(os.path.join(cfg['out_dir'], 'hf'))
    if master:
        trajs = sample.run_episodes(model, gym_, cfg, 'heldout', 4)
        sample.write_html(os.path.join(cfg['out_dir'], sample.EPISODES), trajs, gym_['tok'],
                          title=f"nanoagent · {cfg['gym']} · step {cfg['steps']} · heldout")
        sample.plot_metrics(metrics_path, os.path.join(cfg['out_dir'], sample.CURVES))
        print(sample.run_summary(cfg['out_dir'], cfg, time.time() - t_start))
    if ddp:  # wait for rank 0's final files: a rank that tears gloo down alone can abort (seen under load)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == '__main__':
    main(sys.argv[1:])
