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
(MEM1 trains on a context that differs from its rollout context; we must not). pack_turns packs an
episode's rows into one that holds their shared prompt once (pack_rows): still each turn's context.

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

from dataclasses import dataclass, field

import torch

from gym import OWNER, checked_reset, checked_step, scripted_turn
from model import autocast, generate

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
    mem_mask [T-1] line up with ids[1:] (action_mask: the policy tokens of turns that train, so 0 on a
    scripted mistake's, as in every row; the viewer shows it). rows are the training rows: one for a prefix-stable episode
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


def start_episode(env, task, fmt, group):
    text = checked_reset(env, task)
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
    """End the episode: its reward and info (checked_step's); a stop given here is the rollout's own
    ('max_len' or 'max_turns'): reward 0, not a success."""
    ep.done, ep.kv = True, None
    ep.info, ep.reward, ep.valid = dict(info), reward, not info.get('invalid')
    if stop is not None:
        ep.reward, ep.info['stop'], ep.info['success'] = 0.0, stop, False
    ep.info.setdefault('n_turns', len(ep.turns))


def append_tokens(ep, ids, owner, logp=None, mem_len=0):
    """Extend the episode's un-folded token log by one span of the turn being played."""
    h, t = ep.hist, len(ep.turns) - 1
    h['ids'] += ids
    h['owner'] += owner
    h['turn'] += [t] * len(ids)
    h['logp'] += list(logp) if logp is not None else [0.0] * len(ids)
    h['mem'] += [1] * mem_len + [0] * (len(ids) - mem_len)


def record_turn(ep, fmt, context, response, logp, max_turns, finish_reason, train=True):
    """Append one sampled turn, step the environment (finish_reason 'stop' or 'length', see
    Simplification 2), append its observation. train=False: a scripted mistake that the episode
    plays but no training row learns (its tokens get action_mask 0)."""
    mem_len = fmt.mem_span(response) if fmt.mem_span else 0  # the sampled memory through </mem>
    ep.turns.append(dict(context=context, response=list(response), logp=list(logp), mem_len=mem_len,
                         finish=finish_reason, train=train))
    append_tokens(ep, fmt.turn_prefix, [OWNER['template']] * len(fmt.turn_prefix))
    append_tokens(ep, list(response), [OWNER['policy']] * len(response), logp, mem_len)
    ep.actions.append(fmt.decode(response))
    obs, reward, done, info = checked_step(ep.env, ep.actions[-1], finish_reason)
    ep.turns[-1]['ok'] = bool(info['turn_ok'])  # the gym's verdict on this turn's format
    if done:
        return finish(ep, reward, info)
    if len(ep.turns) >= max_turns:
        return finish(ep, 0.0, info, stop='max_turns')
    o_ids, o_owner = fmt.observation(obs)
    ep.observations.append((o_ids, o_owner))
    ep.texts.append(obs)
    append_tokens(ep, o_ids, o_owner)


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


def full_history_row(traj, max_len):
    """A folded episode's tokens as one training row with the whole un-folded history (the row that
    keep_tool_results='all' would have built for the same turns), cut to its first max_len tokens.
    Trained turns' policy tokens are in its action_mask, scripted mistakes (train=False) are not.
    For the warm start (warmstart_full): MemPO's P_full reads this history (advantage.memory_rewards)."""
    n = min(len(traj.ids), max_len)
    return dict(ids=traj.ids[:n], owner=traj.owner[:n], action_mask=traj.action_mask[:n - 1],
                sample_logp=traj.sample_logp[:n - 1], turn_ids=traj.turn[1:n], mem_mask=traj.mem_mask[:n - 1])


def make_trajectory(ep):
    """Freeze an Episode: tensors shifted to ids[1:] in one place, so masks cannot drift by one."""
    h = ep.hist
    owner, turn = torch.tensor(h['owner']), torch.tensor(h['turn'])
    trained = torch.tensor([t['train'] for t in ep.turns] + [False])  # turn -1 (the prompt) reads the last entry
    contexts = [len(t['context'][0]) for t in ep.turns]
    generated = [len(t['response']) for t in ep.turns]
    info = dict(ep.info, actions=ep.actions, n_turns=len(ep.turns),
                tt=sum(contexts) + sum(generated),  # tokens processed: every turn's context + response
                pt=max((c + g for c, g in zip(contexts, generated)), default=0),  # peak context of a turn
                ht=len(h['ids']))  # the un-folded episode: the peak context of full history for these turns
    return Trajectory(ids=torch.tensor(h['ids']), owner=owner, turn=turn,  # a scripted mistake's tokens: mask 0
                      action_mask=((owner[1:] == OWNER['policy']) & trained[turn[1:]]).float(),
                      sample_logp=torch.tensor(h['logp'][1:], dtype=torch.float32),
                      mem_mask=torch.tensor(h['mem'][1:], dtype=torch.float32),
                      reward=ep.reward, info=info, group=ep.group, valid=ep.valid, task=ep.task, rows=training_rows(ep),
                      turns=ep.turns, prompt_len=len(ep.prompt[0]))


# -----------------------------------------------------------------------------
# sampling


def rollout_batch(policy, fmt, envs, tasks, cfg, groups=None, generator=None, temperature=None):
    """Run len(tasks) episodes in lockstep -> list of Trajectory.

    policy is a model (sampled with its KV cache at cfg['temperature'], or `temperature` if given) or
    a list of scripted text policies, one per episode: functions (episode) -> action text, encoded
    through the same token path with log-prob 0, followed by fmt.end_turn (a chat model's end-of-turn
    token, which the text itself does not write). A scripted policy may return (text, False) for a
    demonstrated mistake: played, but never trained on (the warm start learns the recovery only).
    cfg needs max_turns, max_len, max_response_tokens, keep_tool_results. An episode
    whose next context plus a full response would exceed max_len ends 'max_len', one that uses max_turns
    turns 'max_turns', each with reward 0. Each turn's finish reason goes to env.step (Simplification 2)."""
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
                finish(ep, 0.0, {}, stop='max_len')
                continue
            active.append(i)
            contexts.append(ctx)
        if not active:
            break
        train = [True] * len(active)  # False: a scripted mistake, played but not trained on
        if isinstance(policy, torch.nn.Module):
            caches = [eps[i].kv for i in active] if cfg.get('kv_reuse') else None
            with autocast(cfg):
                out = generate(policy, [c[0] for c in contexts], fmt.stop_ids, cfg['max_response_tokens'],
                               temperature, generator, fmt.pad_id, caches)
            responses, logps = out[:2]
            for i, kv in zip(active, out[2] if caches is not None else []):
                eps[i].kv = kv
            cut = [False] * len(responses)  # generate stops at a stop id or at the budget
        else:
            acts = [scripted_turn(policy[i], eps[i]) for i in active]
            train = [a[1] for a in acts]
            full = [fmt.encode(a[0]) + fmt.end_turn for a in acts]  # as a model ends its turn
            responses = [f[:cfg['max_response_tokens']] for f in full]
            cut = [len(f) > len(r) for f, r in zip(full, responses)]  # even if the cut ends on a stop id
            logps = [[0.0] * len(r) for r in responses]
        for i, ctx, r, lp, c, tr in zip(active, contexts, responses, logps, cut, train):
            reason = 'stop' if r and r[-1] in fmt.stop_ids and not c else 'length'
            record_turn(eps[i], fmt, ctx, r, lp, cfg['max_turns'], reason, tr)
    return [make_trajectory(ep) for ep in eps]


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


EVAL_EPISODES_PER_BATCH = 512  # an evaluation rolls out at most this many episodes at once
EVAL_SEED_OFFSETS = {'eval_tasks': 0, 'val_tasks': 1 << 32, 'train_tasks': 2 << 32}  # a split's own stream
EVAL_PREFIX = {'eval_tasks': 'eval_', 'val_tasks': 'eval_val_'}  # a split's logged metrics (train.py never evaluates train_tasks)
SPLIT_NAMES = {'eval_tasks': 'held-out', 'val_tasks': 'validation', 'train_tasks': 'training'}  # as messages name them


def eval_generator(cfg, split, step, rank=0):
    """The generator an evaluation of gym_[split] ('eval_tasks', 'val_tasks' or 'train_tasks') at
    training step `step` samples from, seeded by cfg['seed'], the step, the split and the process's
    rank. Its own: evaluating never shifts training's random streams. train.py's evaluation and
    sample.py --eval of that step's checkpoint draw from the same one, so they print the same numbers."""
    seed = cfg['seed'] * 7919 + step * 104729 + rank + EVAL_SEED_OFFSETS[split]
    return torch.Generator(device=cfg['device']).manual_seed(seed)


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


PER_TARGET = dict(action_mask=0.0, sample_logp=0.0, turn_ids=-1, mem_mask=0.0)  # [T-1] row keys, their padding


def pack_rows(rows):
    """One episode's training rows -> one row that holds their common prefix once (pack_turns).

    With folding every turn's row starts with the same prompt, about half of SmolLM2's memory rows. The
    packed row is the shared prefix S (the common prefix less its last token) followed by each row's
    rest, a segment that starts with that last common token, so every target of a segment is predicted
    inside it. segments [T] is 0 on S and k on row k's segment (k >= 1): a token sees S and the earlier
    tokens of its own segment, at the positions it had in its row (model.packed_attention), so each
    log-prob is the row's up to float rounding. A segment's last position predicts nothing (masks 0,
    turn -1). S stops before any target that more than one row trains (a token counted twice stays
    twice). Returns the rows unchanged when they share nothing or there is one."""
    n = min(len(r['ids']) for r in rows)
    if len(rows) < 2 or n < 2:
        return rows
    ids = torch.stack([r['ids'][:n] for r in rows])  # [K, n]
    differ = (ids != ids[0]).any(0).nonzero()
    p = max(0, (int(differ[0]) if len(differ) else n) - 1)  # the shared part: the common prefix less its last token
    trained = torch.stack([r['action_mask'][:p] for r in rows])  # [K, p]
    twice = (trained.sum(0) > 1).nonzero()
    p = int(twice[0]) if len(twice) else p
    if p == 0:
        return rows
    src = trained[:, :p].argmax(0)  # each shared target from the row that trains it (p may have shrunk)
    out = dict(ids=torch.cat([rows[0]['ids'][:p]] + [r['ids'][p:] for r in rows]),
               owner=torch.cat([rows[0]['owner'][:p]] + [r['owner'][p:] for r in rows]),
               segments=torch.cat([torch.zeros(p, dtype=torch.long)] +
                                  [torch.full((len(r['ids']) - p,), k + 1) for k, r in enumerate(rows)]))
    for key, pad in PER_TARGET.items():
        shared = torch.stack([r[key][:p] for r in rows]).gather(0, src[None]).squeeze(0)
        gap = torch.full((1,), pad, dtype=rows[0][key].dtype)  # a segment's last token predicts nothing
        out[key] = torch.cat([shared] + [t for r in rows for t in (r[key][p:], gap)][:-1])
    return [out]


def collate(trajs, pad_id, pack=False):
    """Pad the training rows of trajectories into a batch.

    Returns ids, attention_mask, segments [R, L]; action_mask, sample_logp, turn_ids, mem_mask [R, L-1]
    (aligned to ids[:, 1:], padding 0 / turn -1); row_episode [R] (index into trajs); rewards,
    group_ids, valid [N] per episode. R >= N: a folded episode has one row per turn, or with pack one
    row of segments (pack_rows; segments 0 everywhere else). Every episode has a row:
    gym.check_prompts_fit, at set-up, makes sure every first turn fits max_len."""
    rows = [(n, r) for n, t in enumerate(trajs) for r in (pack_rows(t.rows) if pack else t.rows)]
    L = max(len(r['ids']) for _, r in rows)
    return dict(
        ids=pad_stack([r['ids'] for _, r in rows], L, pad_id),
        attention_mask=pad_stack([torch.ones(len(r['ids']), dtype=torch.long) for _, r in rows], L, 0),
        segments=pad_stack([r.get('segments', torch.zeros(len(r['ids']), dtype=torch.long)) for _, r in rows], L, 0),
        action_mask=pad_stack([r['action_mask'] for _, r in rows], L - 1, 0.0),
        sample_logp=pad_stack([r['sample_logp'] for _, r in rows], L - 1, 0.0),
        turn_ids=pad_stack([r['turn_ids'] for _, r in rows], L - 1, -1),
        mem_mask=pad_stack([r['mem_mask'] for _, r in rows], L - 1, 0.0),
        row_episode=torch.tensor([n for n, _ in rows]),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        group_ids=torch.tensor([t.group for t in trajs]),
        valid=torch.tensor([t.valid for t in trajs]),
    )
