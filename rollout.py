"""
Turning a policy and environments into token-level trajectories, token-in/token-out.

Every token of an episode gets an owner (template / prompt / policy / tool) and a turn index. Policy
tokens are stored exactly as sampled, with the log-probability the sampler used; observations are
encoded and appended; policy text is decoded only to hand it to the environment. Nothing sampled is
ever re-encoded.

Each turn also keeps the exact context ids the policy was conditioned on. Without memory folding the
contexts extend one another and an episode trains as one row (its full sequence). With MemPO's
folding (keep_tool_results=1) a turn's context is the prompt, the last <mem> span and the last
observation, so each turn trains as its own row, scored in exactly the context it was sampled in
(MEM1 trains on a context that differs from its rollout context; we must not).

Simplifications, on purpose:
1. Each turn prefills its context in one batched forward and then decodes with the KV cache. By
   default the prefill repeats the previous turns' tokens; with kv_reuse the cache of the longest
   common prefix with the last turn is kept (all of it with full history, the prompt with folding)
   and only the rest is prefilled: the same tokens, up to float rounding, so it is a config choice.
2. The stop token the policy sampled is a policy token. Every turn has a finish reason: 'stop' when
   its response ends with one of fmt.stop_ids, 'length' otherwise (it hit max_response_tokens; a
   scripted text longer than max_response_tokens is cut and is 'length' too). The environment gets
   it, env.step(text, finish), and runs no tool for a 'length' turn: it answers as to a malformed
   call (a turn used, counted invalid), so the policy learns that an unfinished turn fails.
"""

import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gym import OWNER, STOPS, GymContractError, check_turn, strip_end_marker
from model import (autocast, cache_layers, forward_cached, make_cache, micro_batches, position_ids_from_mask, sample_next,
                   select_cache, sequence_log_probs)

# -----------------------------------------------------------------------------
# episodes and trajectories


@dataclass
class Episode:
    env: object
    task: object
    group: int
    prompt: tuple                  # (ids, owners)
    hist: dict                     # the un-folded token log: ids, owner, turn, logp, mem
    turns: list = field(default_factory=list)         # per turn: context (ids, owner, turn), response, logp, mem_len
    observations: list = field(default_factory=list)  # (ids, owners) after each turn
    texts: list = field(default_factory=list)         # prompt, then each observation, as text
    actions: list = field(default_factory=list)       # decoded policy turns
    done: bool = False
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    valid: bool = True             # False when the env raised or the reward was not a finite number
    kv: object = None              # kv_reuse: (per-layer (keys, values), ids) of the last turn's cache


@dataclass
class Trajectory:
    """One episode. ids, owner, turn [T] are the full un-folded sequence; action_mask, sample_logp and
    mem_mask [T-1] line up with ids[1:]. rows are the training rows: one for a prefix-stable episode
    (then identical to the full sequence), one per turn when contexts were folded."""
    ids: torch.Tensor
    owner: torch.Tensor
    turn: torch.Tensor
    action_mask: torch.Tensor
    sample_logp: torch.Tensor
    mem_mask: torch.Tensor
    reward: float
    info: dict
    group: int
    valid: bool
    task: object
    rows: list
    turns: list
    prompt_len: int


def reset_text(env, task):
    """env.reset(task): the prompt text. Raises GymContractError when it is not a str."""
    text = env.reset(task)
    if not isinstance(text, str):
        raise GymContractError(f"{type(env).__name__}.reset returned {type(text).__name__}, not the prompt text (str)")
    return text


def start_episode(env, task, fmt, group):
    text = reset_text(env, task)
    ids, owner = fmt.prompt(text)
    hist = dict(ids=list(ids), owner=list(owner), turn=[-1] * len(ids), logp=[0.0] * len(ids), mem=[0] * len(ids))
    return Episode(env, task, group, (list(ids), list(owner)), hist, texts=[text])


def context_of(ep, fmt, keep_tool_results):
    """The exact (ids, owners, turns) the policy is conditioned on at its next turn.

    keep_tool_results='all': the whole history. An int k (MemPO uses 1): the prompt, the last <mem>
    span as sampled, and the last k observations, rebuilt from ids (never decoded and re-encoded)."""
    t = len(ep.turns)
    prefix = fmt.turn_prefix
    tail = (prefix, [OWNER['template']] * len(prefix), [t] * len(prefix))
    if keep_tool_results == 'all' or t == 0:
        base = (ep.hist['ids'], ep.hist['owner'], ep.hist['turn']) if t else (*ep.prompt, [-1] * len(ep.prompt[0]))
        return [list(base[i]) + list(tail[i]) for i in range(3)]
    ids, owner = list(ep.prompt[0]), list(ep.prompt[1])
    turn = [-1] * len(ids)
    last = ep.turns[-1]
    mem = prefix + last['response'][:last['mem_len']]  # the last memory span, as sampled
    ids += mem + fmt.fold_close
    owner += [OWNER['template']] * len(prefix) + [OWNER['policy']] * last['mem_len'] + [OWNER['template']] * len(fmt.fold_close)
    turn += [t - 1] * (len(mem) + len(fmt.fold_close))
    for k in range(max(0, t - int(keep_tool_results)), t):
        o_ids, o_owner = ep.observations[k]
        ids, owner, turn = ids + o_ids, owner + o_owner, turn + [k] * len(o_ids)
    return ids + tail[0], owner + tail[1], turn + tail[2]


def finish(ep, reward, info, stop=None):
    ep.done, ep.kv = True, None
    ep.info = dict(info or {})
    is_number = isinstance(reward, numbers.Real) and not isinstance(reward, bool)  # numpy's too; not '1', not True
    ep.reward = float(reward) if is_number else math.nan
    if not math.isfinite(ep.reward):  # a NaN reward would poison its group's mean and std
        ep.info.setdefault('error', f'reward {reward!r} is not a finite number')
        ep.reward, ep.valid = 0.0, False
    if not ep.valid:
        ep.info['invalid'] = True
    if stop is not None:
        ep.reward, ep.info['stop'], ep.info['success'] = 0.0, stop, False
    ep.info.setdefault('n_turns', len(ep.turns))


def check_done_info(env, info):
    """A finished episode's info must hold success and a stop in gym.STOPS (the gym contract, gym.py):
    without them success rates would silently count 0. Raises GymContractError (a ValueError) naming
    the env class."""
    name = type(env).__name__
    missing = [k for k in ('success', 'stop') if not isinstance(info, dict) or k not in info]
    if missing:
        raise GymContractError(f"{name}.step returned done=True without info[{missing[0]!r}] (gym.py: a finished "
                         f"episode's info holds success and stop)")
    if info['stop'] not in STOPS:
        raise GymContractError(f"{name}.step returned done=True with info['stop']={info['stop']!r}, not one of gym.STOPS "
                         f"({', '.join(STOPS)})")


def record_turn(ep, fmt, context, response, logp, cfg, finish_reason, train=True):
    """Append one sampled turn to the episode, step the environment (finish_reason 'stop' or
    'length', see Simplification 2), append its observation. train=False: a scripted mistake that
    the episode plays but no training row learns (its tokens get action_mask 0)."""
    t = len(ep.turns)
    mem_len = fmt.mem_span(response) if fmt.mem_span else 0  # the sampled memory through </mem>
    ep.turns.append(dict(context=context, response=list(response), logp=list(logp), mem_len=mem_len,
                         finish=finish_reason, train=train))
    h, n = ep.hist, len(fmt.turn_prefix)
    h['ids'] += fmt.turn_prefix
    h['owner'] += [OWNER['template']] * n
    h['turn'] += [t] * n
    h['logp'] += [0.0] * n
    h['mem'] += [0] * n
    h['ids'] += response
    h['owner'] += [OWNER['policy']] * len(response)
    h['turn'] += [t] * len(response)
    h['logp'] += list(logp)
    h['mem'] += [1] * mem_len + [0] * (len(response) - mem_len)
    action = fmt.decode(response)
    ep.actions.append(action)
    try:
        out = ep.env.step(action, finish_reason)
    except Exception as e:  # an environment that raises invalidates its episode, not the run
        ep.valid = False
        return finish(ep, 0.0, {'error': f'{type(e).__name__}: {e}'}, stop='env_error')
    if not (isinstance(out, tuple) and len(out) == 4):  # the contract (gym.py), broken in every episode
        raise GymContractError(f"{type(ep.env).__name__}.step returned {type(out).__name__}"
                               f"{f' of {len(out)}' if isinstance(out, tuple) else ''}, not (observation, reward, done, info)")
    obs, reward, done, info = out
    if done:
        check_done_info(ep.env, info)  # outside the try: a gym that breaks the contract stops the run
        return finish(ep, reward, info)
    if reward != 0:  # the outcome is per episode: a reward before done would be dropped without a word
        raise GymContractError(f"{type(ep.env).__name__}.step returned reward {reward!r} before done; "
                               f"rewards are per episode, given with done=True")
    if t + 1 >= cfg['max_turns']:
        return finish(ep, 0.0, info, stop='truncated')
    if not isinstance(obs, str):  # the contract (gym.py); encoding it would fail deep inside the tokenizer
        raise GymContractError(f"{type(ep.env).__name__}.step returned a {type(obs).__name__} observation, not text (str)")
    o_ids, o_owner = fmt.observation(obs)
    ep.observations.append((o_ids, o_owner))
    ep.texts.append(obs)
    h['ids'] += o_ids
    h['owner'] += o_owner
    h['turn'] += [t] * len(o_ids)
    h['logp'] += [0.0] * len(o_ids)
    h['mem'] += [0] * len(o_ids)


def training_rows(ep):
    """Pack the turns into training rows: a turn whose context extends the current row (prefix-stable
    history) continues it; any other turn starts a new row. Only a row's own responses are trained:
    a folded context also holds the previous turn's memory span, which trains in its own row."""
    rows = []
    for t, turn in enumerate(ep.turns):
        c_ids, c_owner, c_turn = turn['context']
        row = rows[-1] if rows else None
        if row is None or len(c_ids) < len(row['ids']) or c_ids[:len(row['ids'])] != row['ids']:
            row = dict(ids=[], owner=[], turn=[], logp=[], train=[], mem=[])
            rows.append(row)
        n = len(row['ids'])
        new = len(c_ids) - n
        row['ids'] += c_ids[n:]
        row['owner'] += c_owner[n:]
        row['turn'] += c_turn[n:]
        row['logp'] += [0.0] * new
        row['train'] += [0] * new
        row['mem'] += [0] * new
        r = turn['response']
        row['ids'] += r
        row['owner'] += [OWNER['policy']] * len(r)
        row['turn'] += [t] * len(r)
        row['logp'] += turn['logp']
        row['train'] += [int(turn['train'])] * len(r)
        row['mem'] += [1] * turn['mem_len'] + [0] * (len(r) - turn['mem_len'])
    out = []
    for row in rows:
        out.append(dict(ids=torch.tensor(row['ids']), owner=torch.tensor(row['owner']),
                        action_mask=torch.tensor(row['train'][1:], dtype=torch.float32),
                        sample_logp=torch.tensor(row['logp'][1:], dtype=torch.float32),
                        turn_ids=torch.tensor(row['turn'][1:]),
                        mem_mask=torch.tensor(row['mem'][1:], dtype=torch.float32)))
    return out


def make_trajectory(ep):
    """Freeze an Episode: tensors shifted to ids[1:] in one place, so masks cannot drift by one."""
    h = ep.hist
    owner = torch.tensor(h['owner'])
    contexts = [len(t['context'][0]) for t in ep.turns]
    generated = [len(t['response']) for t in ep.turns]
    info = dict(ep.info, actions=ep.actions, n_turns=len(ep.turns),
                tt=sum(contexts) + sum(generated),  # tokens processed: every turn's context + response
                pt=max((c + g for c, g in zip(contexts, generated)), default=0),  # peak context of a turn
                ht=len(h['ids']))  # the un-folded episode: the peak context of full history for these turns
    return Trajectory(ids=torch.tensor(h['ids']), owner=owner, turn=torch.tensor(h['turn']),
                      action_mask=(owner[1:] == OWNER['policy']).float(),
                      sample_logp=torch.tensor(h['logp'][1:], dtype=torch.float32),
                      mem_mask=torch.tensor(h['mem'][1:], dtype=torch.float32),
                      reward=ep.reward, info=info, group=ep.group, valid=ep.valid, task=ep.task, rows=training_rows(ep),
                      turns=ep.turns, prompt_len=len(ep.prompt[0]))


# -----------------------------------------------------------------------------
# sampling


def stack_caches(model, past, Lc, device):
    """One batch KV cache [B, H, Lc, D] per layer from generate's per-row past: row b's n cached
    positions end at Lc, zeros (masked out) before them; a row without a cache is all zeros."""
    layers, template = [], next(p for p in past if p is not None)[0]
    for li, (k0, v0) in enumerate(template):
        k = k0.new_zeros(len(past), k0.shape[0], Lc, k0.shape[2])
        v = v0.new_zeros(len(past), v0.shape[0], Lc, v0.shape[2])
        for b, p in enumerate(past):
            if p is not None:
                k[b, :, Lc - p[1]:], v[b, :, Lc - p[1]:] = p[0][li][0][:, :p[1]], p[0][li][1][:, :p[1]]
        layers.append((k.to(device), v.to(device)))
    return make_cache(model, layers)


@torch.no_grad()
def generate(model, contexts, stop_ids, max_new_tokens, temperature=1.0, generator=None, pad_id=0, past=None,
             return_caches=False):
    """Sample one response per context with a KV cache: prefill the left-padded contexts in one
    forward, then decode token by token; rows that sampled a stop token leave the batch (and the
    cache). contexts: list of B id lists. Returns (responses, logps): B lists of sampled ids (the stop
    token included) and of their log-probs under the tempered sampling distribution.

    KV reuse across turns: past[b] = (layers, n) holds the cache of the first n tokens of contexts[b]
    from an earlier call (per-layer (keys, values) [H, n, D]; n < len(contexts[b])), so only the rest
    is prefilled; the cached and new tokens sit in one row with padding between them, masked out.
    past[b] = None (or past=None) prefills the whole context. return_caches=True also returns each
    row's cache as (layers, ids): the tokens it holds (its context and its response but the last
    token, which was sampled and never fed)."""
    device = next(model.parameters()).device
    B = len(contexts)
    n_cached = [p[1] if p is not None else 0 for p in (past or [None] * B)]
    Lc, L = max(n_cached), max(len(c) - n for c, n in zip(contexts, n_cached))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, Lc + L, dtype=torch.long)
    for b, (c, n) in enumerate(zip(contexts, n_cached)):
        ids[b, L - len(c) + n:] = torch.tensor(c[n:])
        attn[b, Lc - n:Lc] = 1
        attn[b, Lc + L - len(c) + n:] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = position_ids_from_mask(attn)[:, Lc:]
    cache = stack_caches(model, past, Lc, device) if Lc else None
    logits, cache = forward_cached(model, ids, attn, pos, cache)  # [B, V]: only the last position is projected
    rows = torch.arange(B, device=device)  # which context each live batch row belongs to
    next_pos = pos[:, -1] + 1
    stops = torch.tensor(stop_ids, device=device)
    steps = []  # (rows, ids, logp) per decoding step, assembled once at the end
    kept = [None] * B  # return_caches: each row's (layers, number of its tokens) when it leaves the batch

    def keep_rows(which):
        for j in which.tolist():
            real = attn[j].bool()
            kept[int(rows[j])] = ([(k[j][:, real], v[j][:, real]) for k, v in cache_layers(cache)], int(real.sum()))
    for step in range(max_new_tokens):
        tok, logp = sample_next(logits, temperature, generator)  # [B'], [B']
        steps.append((rows, tok, logp))
        live = ~torch.isin(tok, stops)
        if step == max_new_tokens - 1 or not bool(live.any()):
            break
        if not bool(live.all()):
            keep = live.nonzero().squeeze(1)
            if return_caches:
                keep_rows((~live).nonzero().squeeze(1))
            cache, attn, tok, rows, next_pos = select_cache(cache, keep), attn[keep], tok[keep], rows[keep], next_pos[keep]
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], 1)
        logits, cache = forward_cached(model, tok[:, None], attn, next_pos[:, None], cache)
        next_pos = next_pos + 1
    if return_caches:
        keep_rows(torch.arange(len(rows)))
    responses, logps = [[] for _ in range(B)], [[] for _ in range(B)]
    for r, t, lp in steps:
        for b, i, l in zip(r.tolist(), t.tolist(), lp.tolist()):
            responses[b].append(i)
            logps[b].append(l)
    if not return_caches:
        return responses, logps
    caches = [(kept[b][0], (list(contexts[b]) + responses[b][:-1])[:kept[b][1]]) for b in range(B)]
    return responses, logps, caches


def reusable_cache(kv, context):
    """(layers, n) for generate's past: the part of an episode's last cache (kv = (layers, ids), or
    None) that the next context starts with, its n common leading tokens (at most all but the
    context's last token, which must be fed to get logits), or None when nothing is shared. Full
    history extends the last turn exactly; a folded context shares its prompt."""
    if kv is None:
        return None
    layers, ids = kv
    n, limit = 0, min(len(ids), len(context) - 1)
    while n < limit and ids[n] == context[n]:
        n += 1
    return (layers, n) if n else None


def scripted_turn(said):
    """What a scripted policy returned -> (text, train): text alone trains; (text, False) is a mistake
    to play but not train on. Anything else raises GymContractError."""
    text, train = said if isinstance(said, tuple) and len(said) == 2 else (said, True)
    if not isinstance(text, str) or train not in (True, False):
        raise GymContractError(f"a scripted policy returned {said!r}; it returns the turn's text, or "
                               f"(text, False) for a mistake not to train on")
    return text, train


def rollout_batch(policy, fmt, envs, tasks, cfg, groups=None, generator=None, temperature=None):
    """Run len(tasks) episodes in lockstep -> list of Trajectory.

    policy is a model (sampled with its KV cache at cfg['temperature'], or `temperature` if given) or
    a list of scripted text policies, one per episode: functions (episode) -> action text, encoded
    through the same token path with log-prob 0, followed by fmt.end_turn (a chat model's end-of-turn
    token, which the text itself does not write). A scripted policy may return (text, False) for a
    demonstrated mistake: played, but never trained on (the warm start learns the recovery only).
    cfg needs max_turns, max_len, max_response_tokens, keep_tool_results. An episode
    whose next context plus a full response would exceed max_len, or that uses max_turns turns, ends
    'truncated' with reward 0. Each turn's finish reason goes to env.step (Simplification 2)."""
    temperature = cfg['temperature'] if temperature is None else temperature
    groups = groups if groups is not None else list(range(len(tasks)))
    eps = [start_episode(env, task, fmt, g) for env, task, g in zip(envs, tasks, groups)]
    while True:
        active, contexts = [], []
        for i, ep in enumerate(eps):
            if ep.done:
                continue
            ctx = context_of(ep, fmt, cfg['keep_tool_results'])
            if len(ctx[0]) + cfg['max_response_tokens'] > cfg['max_len']:
                finish(ep, 0.0, {}, stop='truncated')
                continue
            active.append(i)
            contexts.append(ctx)
        if not active:
            break
        train = [True] * len(active)  # False: a scripted mistake, played but not trained on
        if isinstance(policy, torch.nn.Module) and cfg.get('kv_reuse'):
            past = [reusable_cache(eps[i].kv, c[0]) for i, c in zip(active, contexts)]
            with autocast(cfg):
                responses, logps, caches = generate(policy, [c[0] for c in contexts], fmt.stop_ids, cfg['max_response_tokens'],
                                                    temperature, generator, fmt.pad_id, past=past, return_caches=True)
            for i, kv in zip(active, caches):
                eps[i].kv = kv
            cut = [False] * len(responses)
        elif isinstance(policy, torch.nn.Module):
            with autocast(cfg):
                responses, logps = generate(policy, [c[0] for c in contexts], fmt.stop_ids, cfg['max_response_tokens'],
                                            temperature, generator, fmt.pad_id)
            cut = [False] * len(responses)  # generate stops at a stop id or at the budget
        else:
            acts = [scripted_turn(policy[i](eps[i])) for i in active]
            train = [a[1] for a in acts]
            full = [fmt.encode(a[0]) + fmt.end_turn for a in acts]  # as a model ends its turn
            responses = [f[:cfg['max_response_tokens']] for f in full]
            cut = [len(f) > len(r) for f, r in zip(full, responses)]  # even if the cut ends on a stop id
            logps = [[0.0] * len(r) for r in responses]
        for i, ctx, r, lp, c, tr in zip(active, contexts, responses, logps, cut, train):
            reason = 'stop' if r and r[-1] in fmt.stop_ids and not c else 'length'
            record_turn(eps[i], fmt, ctx, r, lp, cfg, reason, tr)
    return [make_trajectory(ep) for ep in eps]


def check_prompts_fit(gym_, cfg):
    """Fail at setup, not mid-run: raise ValueError when some task's first context (its prompt and
    fmt.turn_prefix) plus max_response_tokens exceeds max_len, since rollout_batch would end that
    episode 'truncated' before its first turn. gym_: a dict with fmt, make_env, train_tasks and
    eval_tasks (train.py's gym). Resets a fresh make_env() per task and encodes every prompt (cheap:
    16096 tasks take 0.1 s). Returns the longest first context in tokens."""
    fmt, tasks = gym_['fmt'], list(gym_['train_tasks']) + list(gym_['eval_tasks'])
    longest = max((len(fmt.prompt(reset_text(gym_['make_env'](), t))[0]) for t in tasks), default=0) + len(fmt.turn_prefix)
    if longest + cfg['max_response_tokens'] > cfg['max_len']:
        raise ValueError(f"max_len={cfg['max_len']} is too short: the longest prompt is {longest} tokens and a "
                         f"turn needs max_response_tokens={cfg['max_response_tokens']} more")
    return longest


def run_tasks(policy, gym_, cfg, tasks, group_size=1, groups=None, generator=None, temperature=None):
    """The one entry point that training, evaluation, the warm start and sample.py roll out through:
    each task repeated group_size times, a fresh gym_['make_env']() per episode, group id groups[i]
    for the copies of tasks[i] (default i). policy: a model (put in eval mode) or a list of scripted
    text policies, one per episode. Returns the list of Trajectory, group by group."""
    groups = groups if groups is not None else range(len(tasks))
    reps = [(g, t) for g, t in zip(groups, tasks) for _ in range(group_size)]
    if isinstance(policy, torch.nn.Module):
        policy.eval()
    return rollout_batch(policy, gym_['fmt'], [gym_['make_env']() for _ in reps], [t for _, t in reps], cfg,
                         groups=[g for g, _ in reps], generator=generator, temperature=temperature)


# -----------------------------------------------------------------------------
# collate


def pad_stack(rows, length, value):
    """Right-pad 1-D tensors to `length` -> [B, length]."""
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def episode_rows(row_episode, n_episodes):
    """row_episode [R] (collate's episode index of each row) -> list of n_episodes lists of row indices."""
    rows = [[] for _ in range(n_episodes)]
    for r, e in enumerate(row_episode.tolist()):
        rows[e].append(r)
    return rows


def collate(trajs, pad_id):
    """Pad the training rows of trajectories into a batch.

    Returns ids, attention_mask [R, L]; action_mask, sample_logp, turn_ids, mem_mask [R, L-1] (aligned
    to ids[:, 1:], padding 0 / turn -1); row_episode [R] (index into trajs); rewards, group_ids,
    valid [N] per episode. R >= N: a folded episode has one row per turn. Raises ValueError when no
    trajectory has a row."""
    rows = [(n, r) for n, t in enumerate(trajs) for r in t.rows]
    if not rows:  # no episode took a turn: each prompt plus max_response_tokens exceeded max_len
        raise ValueError(f'collate: no training rows ({len(trajs)} episodes, none reached its first turn; '
                         'is max_len shorter than a prompt plus max_response_tokens? see check_prompts_fit)')
    L = max(len(r['ids']) for _, r in rows)
    return dict(
        ids=pad_stack([r['ids'] for _, r in rows], L, pad_id),
        attention_mask=pad_stack([torch.ones(len(r['ids']), dtype=torch.long) for _, r in rows], L, 0),
        action_mask=pad_stack([r['action_mask'] for _, r in rows], L - 1, 0.0),
        sample_logp=pad_stack([r['sample_logp'] for _, r in rows], L - 1, 0.0),
        turn_ids=pad_stack([r['turn_ids'] for _, r in rows], L - 1, -1),
        mem_mask=pad_stack([r['mem_mask'] for _, r in rows], L - 1, 0.0),
        row_episode=torch.tensor([n for n, _ in rows]),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        group_ids=torch.tensor([t.group for t in trajs]),
        valid=torch.tensor([t.valid for t in trajs]),
    )


# -----------------------------------------------------------------------------
# MemPO's memory reward


def answer_pieces(fmt, answer_text, open_tag='<answer>', close_tag='</answer>'):
    """Ids of a gold answer as the policy writes it, and a 0/1 list marking the answer's own tokens
    (the tags are not scored). answer_text is e.g. '<answer> a1 ; a2 </answer>'."""
    inner = answer_text.strip()[len(open_tag):-len(close_tag)] if answer_text.strip().startswith(open_tag) else answer_text
    o, c, a = fmt.encode(open_tag), fmt.encode(close_tag), fmt.encode(inner)
    return o + a + c, [0] * len(o) + [1] * len(a) + [0] * len(c)


def well_formed(turn, fmt, require_think):
    """True when a <mem> gym's step took this turn (an Episode.turns dict) as well formed: it ended with
    its stop token (finish 'stop') and its text after the forced <mem> passes gym.check_turn."""
    text = '<mem> ' + strip_end_marker(fmt.decode(turn['response']))
    return turn['finish'] == 'stop' and check_turn(text, require_think)[0] is not None


@torch.no_grad()
def memory_probs(model, trajs, fmt, answers, cfg):
    """(where, P_full [M], P_mem [M]) of the M turns memory_rewards scores: where lists their (episode n,
    turn k); see memory_rewards for the two contexts. For diagnosis (scripts/mem_reward_check.py)
    and for memory_rewards."""
    hists, full, short, where = [t.ids.tolist() for t in trajs], [], [], []
    # searchqa's env requires <think> when either key is set; the memory gym reads neither (both stay False)
    require_think = bool(cfg.get('require_think') or cfg.get('enable_thinking'))
    for n, t in enumerate(trajs):
        ans_ids, ans_mask = answer_pieces(fmt, answers[n])
        turn = t.turn.tolist()
        for k in range(1, len(t.turns)):
            mem_len = t.turns[k]['mem_len']
            # a malformed turn already fails its episode; a memory reward on it would rank its span
            # among the real ones (and move its group's normalisation pool)
            if mem_len == 0 or not well_formed(t.turns[k], fmt, require_think):
                continue
            start = turn.index(k)  # turn k's forced prefix, then its response
            end = start + len(fmt.turn_prefix) + mem_len  # the history through turn k's </mem>
            if end + len(ans_ids) > cfg['max_len']:
                continue
            full.append((n, end, ans_ids, ans_mask))
            short.append((hists[n][:t.prompt_len] + hists[n][start:end], ans_ids, ans_mask))
            where.append((n, k))
    if not where:
        return where, torch.zeros(0), torch.zeros(0)
    return where, full_answer_probs(model, hists, full, fmt, cfg), answer_probs(model, short, fmt, cfg)


@torch.no_grad()
def memory_rewards(model, trajs, fmt, answers, cfg):
    """MemPO's memory reward (arXiv 2603.00680, §3) for every turn t >= 2:
    mem_reward_t = P_mem_t - P_full_t, with P = exp(mean log p(gold answer tokens | context)),
      P_full_t: context = the full un-folded history before turn t, then turn t's <mem> span;
      P_mem_t:  context = the prompt, then turn t's <mem> span.
    Both end with the same memory span, so the answer sits where the policy would write it, and the
    difference is what the dropped history still knew that the memory did not carry. No gradient.
    Every P_full context is a prefix of its episode's history (turn t's <mem> follows its forced
    prefix there), so each history is run once and the answers of all its turns are scored on its
    KV cache (full_answer_probs); the P_mem contexts are short and run as plain rows (answer_probs).
    answers: the gold answer text per trajectory. Returns (mem_rewards [N, K], turn_valid [N, K]);
    turns without a closed memory span, that fail the turn format (well_formed) or whose full context
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
