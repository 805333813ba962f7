"""
What a run writes and reads back: per-episode numbers and their means, out_dir (its checks, a fresh
start, resume), checkpoints, metrics.jsonl, the curves PNG, the optional TensorBoard / Weights &
Biases mirror, rollout dumps for sample.py, progress lines and the summary printed at the end.
Nothing here changes a number the trainer computes.
"""

import dataclasses
import glob
import json
import os
import sys
import time
import warnings

import torch
from tqdm import tqdm

from config import all_reduce, config, rank
from gym import TRUNCATED, fail, gym_module

CURVES = 'curves.png'        # file names inside out_dir
EPISODES = 'episodes.html'
# metrics.jsonl keys that are the machine's numbers, not the run's: the same run elsewhere prints others
MACHINE_KEYS = ('step_time_s', 'rollout_time_s', 'update_time_s', 'eval_time_s', 'warmstart_time_s', 'tokens_per_s',
                'mem_reward_time_s', 'peak_memory_gb')

# -----------------------------------------------------------------------------
# episode numbers


def summarise(t):
    """The numbers of one episode that metrics need (small, so ranks can exchange them). An answer
    episode (task.golds: one alias list per objective) that the rollout cut, or an env error ended,
    has no scores in its info: it counts as EM 0 at its task's k, not at k = 1."""
    keys = ('em', 'f1', 'k', 'tt', 'pt', 'ht', 'n_turns', 'mem_quality', 'hop_share', 'n_invalid', 'format_ok')
    out = dict(reward=t.reward, success=bool(t.info.get('success')), stop=t.info.get('stop'), valid=t.valid,
               **{k: t.info[k] for k in keys if k in t.info})
    golds = getattr(getattr(t, 'task', None), 'golds', None)  # an answer gym's task: one alias list per objective
    if golds is not None and 'k' not in out:  # cut by the rollout (or an env error) before the gym scored it
        out['k'] = len(golds)
        out.setdefault('em', 0.0)
        out.setdefault('f1', 0.0)
    if 'mem_rewards' in t.info:  # (memory reward, memory quality) of each scored turn: does the reward track it?
        out['mem_pairs'] = [(r, q) for r, q in zip(t.info['mem_rewards'], t.info.get('mem_quality_turns', ()))
                            if r is not None and q is not None]
    return out


def check_invalid(trajs, what):
    """Invalid episodes (the gym's step raised, or its reward was not a finite number) weigh 0 in the
    update and the warm start and count as failures in an evaluation; one stderr line per `what` (the
    warm start, RL, an evaluation) says so once, naming the first error. All invalid: the gym is
    broken, exit 2 with one line (train.py and sample.py alike)."""
    bad = [t.info.get('error', 'invalid') for t in trajs if not t.valid]
    n_bad, n = all_reduce(float(len(bad))), all_reduce(float(len(trajs)))
    if n_bad and n_bad == n:
        fail(f"{what}: every episode is invalid; the first: {bad[0]}")
    if n_bad and what not in _WARNED and rank() == 0:
        _WARNED.add(what)
        fate = {'RL': ', left out of the update, logged as invalid_episodes', 'warm start': ', not imitated'}.get(what, '')
        print(f"warning: {what}: {n_bad:.0f} of {n:.0f} episodes invalid (reward 0{fate}); the first: {bad[0]}",
              file=sys.stderr)


_WARNED = set()


def episode_metrics(eps, prefix=''):
    """Means over episode summaries (reward_nonzero: the share of episodes whose reward is not 0,
    what a sparse reward gives GRPO to work with; truncation_rate, and stop_<reason> the share cut by
    each limit in gym.TRUNCATED; invalid_episodes, a count, not a share: episodes whose env raised or
    paid a non-number, check_invalid); memory gyms add EM/F1/TT/PT and truncation overall and per
    objective count k (and success_rate_k), and the memory gym's mem_quality (gyms/memory.py memory_quality) and
    hop_share (the share of the question's hops found in order, MemoryEnv), each the mean over the episodes that have one.
    Format, for gyms whose env reports format_ok (the <mem> turn format): format_ok, the fraction of
    episodes whose every turn keeps the format and that end in an answer (an episode cut by the
    rollout, which has no format_ok, counts as not ok), and turn_format_ok, the fraction of turns that
    are well formed (1 - n_invalid / n_turns over the episodes whose info counts invalid turns)."""
    n = max(len(eps), 1)
    out = {f'{prefix}reward_mean': sum(e['reward'] for e in eps) / n,
           f'{prefix}reward_nonzero': sum(e['reward'] != 0 for e in eps) / n,  # the share a sparse reward (EM, F1) rewards at all
           f'{prefix}success_rate': sum(e['success'] for e in eps) / n,
           f'{prefix}truncation_rate': sum(e['stop'] in TRUNCATED for e in eps) / n,  # out of turns or context
           f'{prefix}invalid_episodes': sum(not e['valid'] for e in eps),  # a count: the env raised or paid a non-number
           **{f'{prefix}stop_{why}': sum(e['stop'] == why for e in eps) / n for why in TRUNCATED},  # which limit
           f'{prefix}tt': sum(e.get('tt', 0) for e in eps) / n,  # tokens processed per episode
           f'{prefix}pt': sum(e.get('pt', 0) for e in eps) / n}  # mean over episodes of the peak context
    if any('format_ok' in e for e in eps):  # the <mem> turn-format gyms (memory, searchqa)
        out[f'{prefix}format_ok'] = sum(bool(e.get('format_ok')) for e in eps) / n
        counted = [e for e in eps if 'n_invalid' in e]
        out[f'{prefix}turn_format_ok'] = 1 - sum(e['n_invalid'] for e in counted) / max(sum(e['n_turns'] for e in counted), 1)
    if any('em' in e for e in eps):
        by_k = {}
        for e in eps:
            by_k.setdefault(e.get('k', 1), []).append(e)
        for suffix, es in [('', eps)] + [(f'_k{k}', v) for k, v in sorted(by_k.items())]:
            for key in ('em', 'f1', 'tt', 'pt', 'ht'):  # ht: the full history of the same episodes
                out[f'{prefix}{key}{suffix}'] = sum(float(e.get(key, 0.0)) for e in es) / len(es)
            if suffix:  # overall: success_rate and truncation_rate above
                out[f'{prefix}success_rate{suffix}'] = sum(e['success'] for e in es) / len(es)
                out[f'{prefix}truncation_rate{suffix}'] = sum(e['stop'] in TRUNCATED for e in es) / len(es)
            for key in ('mem_quality', 'hop_share'):  # memory gym: over the episodes that have one
                values = [e[key] for e in es if e.get(key) is not None]
                if values:
                    out[f'{prefix}{key}{suffix}'] = sum(values) / len(values)
    out.update(quality_corr([p for e in eps for p in e.get('mem_pairs', ())], f'{prefix}mem_reward_quality_corr'))
    return out


def quality_corr(pairs, key):
    """{key: Pearson correlation of the (memory reward, memory quality) pairs}, or {} when there are
    fewer than 3 or either side is constant."""
    if len(pairs) < 3:
        return {}
    r, q = torch.tensor(pairs, dtype=torch.float64).T
    r, q = r - r.mean(), q - q.mean()
    denom = float(r.norm() * q.norm())
    return {key: float(r @ q) / denom} if denom > 0 else {}


# -----------------------------------------------------------------------------
# checkpoints: one dict (model, optimizer, step, config, RNG states, reference, vocabulary)


CHECKPOINTS = 'ckpt_' + '[0-9]' * 6 + '.pt'  # the glob of this project's checkpoints: never a user's ckpt_best.pt
ROLLOUT_DUMPS = 'rollout_' + '[0-9]' * 6 + '.pt'  # dump_rollouts' files (rollout_path): never a user's rollout_best.pt


def checkpoint_path(out_dir, step):
    """out_dir/ckpt_<step>.pt, zero-padded so that names sort as steps do (CHECKPOINTS globs them)."""
    return os.path.join(out_dir, f'ckpt_{step:06d}.pt')


def run_files(out_dir, pattern):
    """The files of out_dir that match pattern (CHECKPOINTS, ROLLOUT_DUMPS), sorted: regular files only, so
    that a user's folder named like one is never loaded, renamed or removed."""
    return sorted(p for p in glob.glob(os.path.join(out_dir, pattern)) if os.path.isfile(p))


def rollout_path(out_dir, step):
    """out_dir/rollout_<step>.pt, the training batch dump_rollouts writes at an evaluation step (ROLLOUT_DUMPS globs them)."""
    return os.path.join(out_dir, f'rollout_{step:06d}.pt')


def save_checkpoint(state, out_dir, step, keep):
    """Write ckpt_<step>.pt atomically (temporary file, then rename) and keep the newest `keep` up to
    this step, and step 0's, the warm start, which a comparison of RL recipes resumes from (--resume=True
    in a copy of the run). A checkpoint of a later step is neither counted nor removed: it would
    otherwise push out the one just written (a resume renames those it skipped as corrupt to *.corrupt)."""
    path = checkpoint_path(out_dir, step)
    tmp = path + '.tmp'
    torch.save(state, tmp)
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    mine = [p for p in run_files(out_dir, CHECKPOINTS) if checkpoint_path(out_dir, 0) < p <= path]
    for old in mine[:-keep]:
        os.remove(old)
    return path


def read_checkpoint(path):
    """The state dict saved at path (model, step, config, ...). Raises what torch.load raises on a
    torn or foreign file, and ValueError on a file that loads but is not a nanoagent checkpoint."""
    state = torch.load(path, map_location='cpu', weights_only=False)  # our own file
    if not isinstance(state, dict) or not {'model', 'step', 'config'} <= set(state):
        raise ValueError('not a nanoagent checkpoint')
    return state


def load_latest_checkpoint(out_dir, if_all_corrupt):
    """The newest checkpoint in out_dir that loads; a corrupt one is reported and skipped.
    Returns (state, path) or (None, None) when there is none. When there are checkpoints but none
    loads, exits 2 with one line ending in the caller's advice `if_all_corrupt`: nothing is deleted."""
    paths = run_files(out_dir, CHECKPOINTS)[::-1]
    for path in paths:
        try:
            return read_checkpoint(path), path
        except Exception as e:
            print(f'checkpoint {path} is corrupt ({type(e).__name__}); trying the previous one', file=sys.stderr)
    if paths:
        fail(f"no checkpoint in {out_dir} loads (all corrupt, see above); move them away or {if_all_corrupt}")
    return None, None


MODEL_SHAPE = ('n_layer', 'n_head', 'n_embd', 'max_len')  # config keys that size the tiny model
METRICS = 'metrics.jsonl'
CONFIG = 'config.json'


RUN_KEYS = ('steps', 'resume', 'overwrite', 'out_dir', 'threads', 'log_every', 'eval_every', 'save_every',
            'keep_checkpoints', 'tensorboard', 'wandb_project', 'dump_rollouts')  # change freely on a resume


def check_out_dir(cfg, master=True):
    """--resume's newest loadable checkpoint as (state, path), or None for a fresh run. Exits 2 with
    one line before a fresh run would replace an earlier run in out_dir without overwrite=True, or
    when --resume finds another run's checkpoint (other gym, model, seed, tasks, a value of the gym's
    TASK_KEYS or tiny-model shape),
    a checkpoint past `steps`, or metrics without any checkpoint, and before a fresh run would replace
    a curves.png or a config.json of other settings (a file of the user's); warns of other settings that differ
    from the checkpoint's (they apply from here on; steps too where min_lr >= 0 sets a cosine schedule
    that ends there), or notes that they change nothing when the run is finished. Runs before the gym's set-up."""
    state, path = (load_latest_checkpoint(cfg['out_dir'], 'run with --overwrite=True instead of --resume=True to start again')
                   if cfg['resume'] else (None, None))
    old, dumps = run_files(cfg['out_dir'], CHECKPOINTS), run_files(cfg['out_dir'], ROLLOUT_DUMPS)
    metrics = os.path.exists(os.path.join(cfg['out_dir'], METRICS))
    keys = ('gym', 'model', 'seed', 'eval_tasks', 'val_tasks', 'lora_rank') + (MODEL_SHAPE if cfg['model'] == 'tiny' else ())
    keys += tuple(k for k in getattr(gym_module(cfg), 'TASK_KEYS', ()) if k not in keys)
    differ = [k for k in keys if state is not None and state['config'].get(k, cfg[k]) != cfg[k]]
    if {'gym', 'model'} & set(differ):  # another gym or model: that is the reason (its other keys came from the defaults)
        differ = [k for k in differ if k in ('gym', 'model')]
    if differ:
        fail(f"--resume=True: {cfg['out_dir']} was trained with "
             + ', '.join(f"{k} {state['config'][k]!r}, not {cfg[k]!r}" for k in differ)
             + "; choose another out_dir for a new run")
    if state is not None and state['step'] > cfg['steps']:
        fail(f"--resume=True: the newest checkpoint is at step {state['step']}, past steps={cfg['steps']}")
    if cfg['resume'] and not old and metrics:  # killed before its first checkpoint, or they were moved away
        fail(f"--resume=True: {cfg['out_dir']} holds {METRICS} but no checkpoint to continue from; "
             f"--overwrite=True replaces the run, or choose another out_dir")
    if state is None and (old or metrics or dumps) and not cfg['overwrite']:  # a fresh run would mix its files with these
        fail(f"{cfg['out_dir']} holds an earlier run ({len(old)} checkpoint(s), {METRICS} "
             f"{'present' if metrics else 'absent'}{f', {len(dumps)} rollout dump(s)' if dumps else ''}): "
             f"--resume=True continues it, "
             f"--overwrite=True replaces it, or choose another out_dir")
    if state is None and not cfg['overwrite']:  # files a run writes, but no run: a user's, or another set-up's
        try:
            saved = read_run_config(cfg['out_dir'])
        except ValueError:
            saved = {}
        # config.json of this same config: a run stopped before its first checkpoint, whose curves.png is its own too
        own = saved is not None and all(saved.get(k) == v for k, v in cfg.items() if k not in RUN_KEYS + ('device',))
        kept = [f for f, keep in ((CONFIG, saved is not None and not own),
                                  (CURVES, not own and os.path.exists(os.path.join(cfg['out_dir'], CURVES)))) if keep]
        if kept:
            fail(f"{cfg['out_dir']} holds {' and '.join(kept)}, which this run would replace: "
                 f"--overwrite=True replaces them, or choose another out_dir")
    schedule = ('steps',) if cfg['min_lr'] >= 0 else ()  # with min_lr the cosine decay ends at the last step
    changed = [f"{k} {v!r} there, {cfg[k]!r} here" for k, v in (state or {}).get('config', {}).items()
               if k in cfg and (k not in RUN_KEYS or k in schedule) and v != cfg[k]]
    if changed and master and state['step'] < cfg['steps']:
        print(f"warning: --resume=True: the run goes on with settings other than its checkpoint's: {'; '.join(changed)}",
              file=sys.stderr)
    elif changed and master:  # a finished run trains nothing more
        print(f"note: --resume=True: the run is finished, so settings other than its checkpoint's change nothing: "
              f"{'; '.join(changed)}", file=sys.stderr)
    return (state, path) if state is not None else None


def start_fresh(cfg, master=True):
    """A fresh run's out_dir: made (only now: a set-up that failed leaves none behind); with
    overwrite=True the earlier run's checkpoints and rollout dumps removed (check_out_dir refused
    them otherwise; nothing else is touched but metrics.jsonl, which step 0 starts anew);
    config.json written before the warm start, so a run stopped during it still says what it was."""
    try:
        os.makedirs(cfg['out_dir'], exist_ok=True)
    except OSError as e:
        fail(f"cannot create out_dir {cfg['out_dir']!r}: {e.strerror}")
    if not master:
        return
    if cfg['resume']:
        print(f"--resume=True: no checkpoint in {cfg['out_dir']}, starting from scratch")
    old = run_files(cfg['out_dir'], CHECKPOINTS)
    dumps = run_files(cfg['out_dir'], ROLLOUT_DUMPS) if cfg['overwrite'] else []
    metrics = cfg['overwrite'] and os.path.exists(os.path.join(cfg['out_dir'], METRICS))  # step 0 starts it anew
    gone = [f'{n} {what}' for n, what in ((len(old), 'checkpoint(s)'), (len(dumps), 'rollout dump(s)')) if n]
    said = ([f"removing {' and '.join(gone)}"] if gone else []) \
        + ([f"its {METRICS} is started anew at step 0"] if metrics else [])
    if said:
        print(f"overwrite: an earlier run in {cfg['out_dir']}: {', '.join(said)}")
        for p in old + dumps:
            os.remove(p)
    write_config(cfg)


def read_run_config(out_dir):
    """out_dir/config.json as a dict, None when there is none. Raises ValueError (one line naming the
    file) when it is not a JSON object."""
    path = os.path.join(out_dir, CONFIG)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable config ({type(e).__name__}): fix it or move it away") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a {type(saved).__name__}, not a config (a JSON object): fix it or move it away")
    return saved


def saved_config(out_dir):
    """out_dir/config.json as a dict, {} when there is none; exits 2 with read_run_config's one line
    when it is not a readable config."""
    try:
        return read_run_config(out_dir) or {}
    except ValueError as e:
        fail(str(e))


def resume_base(out_dir, argv):
    """--resume's base config: saved_config(out_dir). Exits 2 with one line when out_dir holds no run (no
    config.json, no checkpoint) and argv names no YAML file: the defaults would start a run nobody asked
    for, in what is most likely a mistyped folder."""
    saved = saved_config(out_dir)
    if not saved and not run_files(out_dir, CHECKPOINTS) and all(a.startswith('-') for a in argv):
        fail(f"--resume=True: {out_dir} holds no run to continue (no {CONFIG}, no checkpoint); to start one there, "
             f"name its config: python train.py config/NAME.yaml --out_dir={out_dir}")
    return saved


def write_config(cfg):
    """out_dir/config.json: the config this run trains with (sample.py --untrained reads it), written
    to a temporary file and renamed, so a run killed mid-write leaves the old file or the new one."""
    path = os.path.join(cfg['out_dir'], CONFIG)
    with open(path + '.tmp', 'w') as f:
        json.dump(cfg, f, indent=1)
    os.replace(path + '.tmp', path)


def restore(ckpt, cfg, model, opt, rng, gen, rank=0):
    """Continue the run of ckpt = (state, path): weights and optimizer into model and opt, every random
    stream, metrics.jsonl cut back to the checkpoint's step (later lines belong to steps that run
    again), newer checkpoints that did not load renamed *.corrupt (out of the rotation, which would
    keep them and drop a good one), config.json rewritten when steps are left to train. Returns
    (step, the KL reference's state dict or None). Exits 2 when the run needs a KL reference of its
    own that the checkpoint lacks."""
    state, path = ckpt
    load_weights(model, state, cfg, path, opt)
    if cfg['kl_coef'] and not cfg['lora_rank'] and state.get('ref_model') is None and state['step'] > 0:
        fail(f"{path} has no KL reference (its run had kl_coef 0): resume with kl_coef 0, or copy its "
             f"ckpt_000000.pt into a new out_dir and resume there (step 0's weights are the reference)")
    rng.setstate(state['rng']['python'])
    torch.set_rng_state(state['rng']['torch'])
    gen.set_state(state['rng']['gen'][min(rank, len(state['rng']['gen']) - 1)])
    if rank == 0:
        for p in run_files(cfg['out_dir'], CHECKPOINTS):
            if p > path:  # skipped as corrupt by load_latest_checkpoint
                os.replace(p, p + '.corrupt')
                print(f"--resume=True: {p} did not load; renamed to {os.path.basename(p)}.corrupt")
        metrics = os.path.join(cfg['out_dir'], METRICS)
        lines = [json.dumps(r) + '\n' for r in read_metrics(metrics) if r['step'] <= state['step']] \
            if os.path.exists(metrics) else []  # read_metrics skips a line torn by a kill
        open(metrics, 'w').writelines(lines)
        if state['step'] < cfg['steps']:  # a finished run resumed keeps its config.json
            write_config(cfg)
        print(f"resumed from {path} at step {state['step']}" + ('' if state['step'] < cfg['steps'] else
              f": the run is finished (steps={cfg['steps']}); --steps=N with a larger N trains it further"))
    return state['step'], state.get('ref_model') if cfg['kl_coef'] else None


def load_weights(model, state, cfg, path, opt=None):
    """Load a checkpoint's model (and optimizer) state; a checkpoint that does not fit cfg (another
    model, size or gym: the checkpoint's state['config']) exits 2 with one line naming what differs."""
    try:
        model.load_state_dict(state['model'])
        if opt is not None:
            opt.load_state_dict(state['optimizer'])
    except (RuntimeError, ValueError, KeyError) as e:
        was = state.get('config', {})
        changed = [f'{k} {was[k]!r} there, {cfg[k]!r} here' for k in ('model', *MODEL_SHAPE, 'lora_rank', 'gym')
                   if k in was and was[k] != cfg[k]]
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        fail(f'{path} does not fit this config: {"; ".join(changed) or lines[min(1, len(lines) - 1)]}')


# -----------------------------------------------------------------------------
# rollout dumps (sample.py --metrics_rollout)


def episode_advantages(trajs, batch, adv):
    """Map the trainer's per-row advantages adv [R, L-1] (rows as collate() made them) back onto each
    episode's full sequence -> list of [T-1] tensors, 0 off policy tokens.

    Every sampled response is trained in exactly one row and the rows of an episode come in turn
    order, so the masked row entries, concatenated, are the episode's policy tokens in order."""
    out = []
    for n, t in enumerate(trajs):
        rows = (batch['row_episode'] == n).nonzero().squeeze(1).tolist()
        vals = torch.cat([adv[r][batch['action_mask'][r].bool()] for r in rows]).float().cpu()
        full = torch.zeros(len(t.ids) - 1)
        pol = t.action_mask.bool()
        assert int(pol.sum()) == len(vals), 'rows and episode disagree on the policy tokens'
        full[pol] = vals
        out.append(full)
    return out


def dump_rollout(path, trajs, batch, adv, cfg, step):
    """Save one training batch for `sample.py --metrics_rollout=path`: the trajectories (training rows
    dropped, they are rebuilt from the full sequence), per-episode advantages [T-1], config, step."""
    state = dict(step=step, config=cfg, advantages=episode_advantages(trajs, batch, adv),
                 trajs=[dataclasses.replace(t, rows=[]) for t in trajs])
    torch.save(state, path + '.tmp')
    os.replace(path + '.tmp', path)
    return path


# -----------------------------------------------------------------------------
# curves, external loggers, run summary

PANELS = [  # (title, metrics.jsonl keys, log scale); eval_baseline_* are drawn dashed on held-out success
    ('train reward / success', ['reward_mean', 'success_rate'], False),
    ('held-out success', ['eval_success_rate', 'eval_greedy_success'], False),
    ('held to the warm start: KL, sft_loss', ['kl', 'sft_loss'], False),  # sft_loss: PPO-ptx (sft_coef > 0)
    ('entropy (nats / policy token)', ['entropy'], False),
    ('clip fraction', ['clip_frac'], False),
    ('truncation rate', ['truncation_rate', 'eval_truncation_rate'], False),
    ('context per episode (tokens)', ['tt', 'pt', 'eval_tt', 'eval_pt'], False),  # tt processed, pt peak
    ('logp_gap_max (sampler vs trainer)', ['logp_gap_max'], True),
    ('turns per episode', ['turns_mean'], False),
]


def read_metrics(path):
    """metrics.jsonl -> list of dicts; a line that is not a JSON object (a half-written last line of a
    run killed mid-write, an edit) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


_NOTICES = set()


def plot_metrics(metrics_path, png_path):
    """A 3x3 PNG of the main curves of metrics.jsonl against step (see PANELS). Keys a run did not
    log leave their panel empty. Returns png_path, or None without matplotlib (a notice, once per process)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: the Agg canvas, no global figure state
    except ImportError:
        if 'matplotlib' not in _NOTICES:  # once per process: train.py calls this at every evaluation
            print('plot_metrics: matplotlib is not installed, no curves (pip install matplotlib)')
            _NOTICES.add('matplotlib')
        return None
    rows = read_metrics(metrics_path)
    fig = Figure(figsize=(13, 9), layout='constrained')
    for ax, (title, keys, log) in zip(fig.subplots(3, 3).flat, PANELS):
        ax.set_title(title, fontsize=10)
        for key in keys:
            pts = [(r['step'], r[key]) for r in rows if _number(r.get(key))]
            if pts:
                xs, ys = zip(*pts)
                ys = [max(y, 1e-12) for y in ys] if log else ys  # a gap of exactly 0 has no logarithm
                ax.plot(xs, ys, marker='o' if len(pts) < 30 else None, ms=3, label=key)
        if title == 'held-out success':
            last = {k: v for r in rows for k, v in r.items() if k.startswith('eval_baseline_') and _number(v)}
            for i, (k, v) in enumerate(sorted(last.items())):
                ax.axhline(v, ls='--', lw=1, color=f'C{(i + 2) % 10}', label=k[len('eval_baseline_'):])
        if log:
            ax.set_yscale('log')
            ax.axhline(1e-5, ls=':', color='gray', label='1e-5 bound')
        if ax.has_data():
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, 'not logged', ha='center', va='center', color='gray', transform=ax.transAxes)
        ax.set_xlabel('step', fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(metrics_path)
    with warnings.catch_warnings():  # a run of one evaluation (steps: 0) has single-point axes; matplotlib widens them
        warnings.filterwarnings('ignore', 'Attempting to set identical')
        fig.savefig(png_path, dpi=80)
    return png_path


_loggers = {}  # 'tensorboard' / 'wandb' -> writer, run, or False when unavailable


def _logger(kind, cfg):
    if kind not in _loggers:
        try:
            if kind == 'tensorboard':
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
                _loggers[kind] = SummaryWriter(os.path.join(cfg['out_dir'], 'tb'))
            else:
                import wandb
                _loggers[kind] = wandb.init(project=cfg['wandb_project'], config=cfg, dir=cfg['out_dir'])
        except ImportError:
            print(f'log_external: {kind} is not installed; logging to metrics.jsonl only')
            _loggers[kind] = False
    return _loggers[kind]


def open_external(cfg):
    """Open the TensorBoard writer and the wandb run the config asks for (a missing package: one notice)."""
    for kind, wanted in (('tensorboard', cfg.get('tensorboard')), ('wandb', cfg.get('wandb_project'))):
        if wanted:
            _logger(kind, cfg)


def log_external(cfg, log, step):
    """Mirror one metrics line (numbers only) to TensorBoard when cfg['tensorboard'] and to wandb when
    cfg['wandb_project'] is set, each only if installed (a missing one prints one notice)."""
    scalars = {k: float(v) for k, v in log.items() if k != 'step' and _number(v)}
    if cfg.get('tensorboard') and _logger('tensorboard', cfg):
        w = _loggers['tensorboard']
        for k, v in scalars.items():
            w.add_scalar(k, v, step)
        w.flush()
    if cfg.get('wandb_project') and _logger('wandb', cfg):
        _loggers['wandb'].log(scalars, step=step)


def print_setup(cfg, gym_, model, seconds, processes):
    """The resolved config (one JSON line) and one line on the gym and the policy; then the TensorBoard
    writer and wandb run open, so that a missing package is said now, not after the warm start."""
    print(json.dumps(cfg))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    val = f" / {len(gym_['val_tasks'])} validation" if gym_.get('val_tasks') else ''
    n_rl, spare = len(gym_['rl_tasks']), cfg['rl_spare_turns']
    rl = f"{n_rl} for RL" if n_rl != len(gym_['train_tasks']) else ''
    if spare != config['rl_spare_turns']:  # the memory gym's RL budget
        rl = f"{rl or 'RL'} with {spare} spare turn(s)"
    rl = f" ({rl})" if rl else ''
    print(f"gym {cfg['gym']}: {len(gym_['train_tasks'])} train{rl} / {len(gym_['eval_tasks'])} held-out{val} tasks "
          f"({seconds:.0f}s); policy {cfg['model']}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
          + (f" ({trained:,} trained: LoRA rank {cfg['lora_rank']})" if cfg['lora_rank'] else '')
          + f"; {processes} process(es)")
    open_external(cfg)


def log_step(cfg, log, gym_):
    """Append one line to out_dir/metrics.jsonl (step 0 starts the file) and mirror it to TensorBoard /
    wandb; at an evaluation also print its line (print_eval) and, after step 0, redraw the curves."""
    path = os.path.join(cfg['out_dir'], METRICS)
    with open(path, 'w' if log['step'] == 0 else 'a') as f:
        f.write(json.dumps(log) + '\n')
    log_external(cfg, log, log['step'])
    if 'eval_success_rate' in log:
        print_eval(log, gym_)
        if log['step']:  # one point is no curve; finish_run draws them at the end anyway
            plot_metrics(path, os.path.join(cfg['out_dir'], CURVES))


def finish_run(cfg, hf_model, tok, wall_s):
    """The end of a run: a Hugging Face policy (hf_model, LoRA folded in; None for the tiny model)
    saved to out_dir/hf, which transformers or vLLM can load and serve; the curves; the summary."""
    if hf_model is not None:
        hf_model.save_pretrained(os.path.join(cfg['out_dir'], 'hf'), safe_serialization=True)
        tok.save_pretrained(os.path.join(cfg['out_dir'], 'hf'))
    plot_metrics(os.path.join(cfg['out_dir'], METRICS), os.path.join(cfg['out_dir'], CURVES))
    print(run_summary(cfg['out_dir'], cfg, wall_s))


def run_summary(out_dir, cfg, wall_s):
    """A few lines for the end of a run: steps, wall time, tokens processed, the largest step's peak
    memory, invalid episodes (when any: RL steps' and evaluations' counts summed), best
    held-out (and validation) score, the paths of the newest checkpoint, metrics and curves (marked
    when missing), and the command that shows the policy's episodes."""
    metrics = os.path.join(out_dir, 'metrics.jsonl')
    rows = read_metrics(metrics) if os.path.exists(metrics) else []
    steps = max((r['step'] for r in rows), default=0)
    # tokens: every turn's context plus its response; step lines carry it as tokens or tokens_per_s x step_time_s
    tokens = sum(r['tokens'] if _number(r.get('tokens')) else r.get('tokens_per_s', 0) * r.get('step_time_s', 0)
                 for r in rows if r['step'] > 0)
    lines = [f"run summary: gym {cfg.get('gym')}, model {cfg.get('model')}",
             f"  steps        {steps} / {cfg.get('steps')}",
             f"  wall time    {int(wall_s // 60)}m {wall_s % 60:.0f}s",
             f"  tokens       {f'{tokens / 1e6:.2f}M' if tokens >= 10_000 else f'{tokens:,.0f}'} processed (contexts + responses, RL steps)"]
    peaks = [r['peak_memory_gb'] for r in rows if _number(r.get('peak_memory_gb'))]
    if peaks:  # what the machine must hold: the largest step's peak (resident set on the CPU, allocated on CUDA)
        lines.append(f"  peak memory  {max(peaks):.1f} GB (an RL step's)")
    rl_bad = sum(r['invalid_episodes'] for r in rows if _number(r.get('invalid_episodes')))
    eval_bad = sum(v for r in rows for k, v in r.items()
                   if k.startswith('eval_') and k.endswith('invalid_episodes') and _number(v))
    if rl_bad or eval_bad:  # a broken env or reward: the warnings name the first of each kind
        lines.append(f"  invalid      {rl_bad:.0f} RL episode(s) (left out of the update), {eval_bad:.0f} evaluation episode(s) "
                     f"(greedy and sampled, every split and step; reward 0): the env raised or paid a non-number")
    for key in ('eval_success_rate', 'eval_greedy_success', 'eval_val_success'):  # choose on validation
        pts = [(r[key], r['step']) for r in rows if _number(r.get(key))]
        if pts:
            best, at = max(pts, key=lambda p: (p[0], -p[1]))
            lines.append(f"  best {key:<20} {best:.3f} at step {at} (step 0: {pts[0][0]:.3f}, last: {pts[-1][0]:.3f})")
    base = {k[len('eval_baseline_'):]: v for r in rows for k, v in r.items() if k.startswith('eval_baseline_')}
    if base:
        lines.append('  baselines    ' + ', '.join(f'{k} {v:.3f}' for k, v in sorted(base.items())))
    ckpts = run_files(out_dir, CHECKPOINTS)
    last = checkpoint_path(out_dir, steps)  # this run's last save, not a stray newer-named file
    for name, path in [('checkpoint', last if last in ckpts else ckpts[-1] if ckpts else os.path.join(out_dir, 'ckpt_*.pt')),
                       ('metrics', metrics), ('curves', os.path.join(out_dir, CURVES))]:
        lines.append(f"  {name:<12} {path}" + ('' if os.path.exists(path) else '  (missing)'))
    lines.append(f"  episodes     python sample.py --out_dir={out_dir} --html={os.path.join(out_dir, EPISODES)}")
    return '\n'.join(lines)


# -----------------------------------------------------------------------------
# progress on the terminal or in a log file


def progress(iterable, desc, cfg, status=None, initial=0, total=None, show=True):
    """tqdm's bar on a terminal; elsewhere (a log file) a plain line every cfg['log_every']
    iterations, with status() appended when given; nothing when show is False (ranks > 0).
    Yields the items of iterable."""
    if not show:
        yield from iterable
        return
    if sys.stderr.isatty():
        yield from tqdm(iterable, desc=desc, initial=initial, total=total)
        return
    total = total or len(iterable)
    t0 = time.time()
    for i, item in enumerate(iterable, initial + 1):
        yield item
        if i % cfg['log_every'] == 0 or i == total:
            print(f'{desc} {i}/{total} ({time.time() - t0:.0f}s)' + (f': {status()}' if status else ''), flush=True)


def print_eval(log, gym_):
    """One line of held-out numbers: step, train success (RL steps), held-out sampled and greedy
    success, the same on the validation split when the gym has one, the gym's reference baselines,
    and for answer gyms EM per number of objectives k, the memory quality and format validity
    (episodes, turns: episode_metrics)."""
    tqdm.write(f"step {log['step']}: " + (f"train success {log['success_rate']:.3f}, " if 'success_rate' in log else '')
               + f"held-out success {log['eval_success_rate']:.3f} (greedy {log['eval_greedy_success']:.3f})"
               + (f", validation {log['eval_val_success']:.3f} (greedy {log['eval_val_greedy_success']:.3f})"
                  if 'eval_val_success' in log else '')
               + ''.join(f', {k} {v:.3f}' for k, v in gym_['baselines'].items())
               + (', EM ' + ' '.join(f"k={k[len('eval_em_k'):]} {v:.3f}" for k, v in log.items() if k.startswith('eval_em_k'))
                  if any(k.startswith('eval_em_k') for k in log) else '')
               + (f", memory quality {log['eval_mem_quality']:.3f}" if 'eval_mem_quality' in log else '')
               + (f", format ok {log['eval_format_ok']:.3f} (turns {log['eval_turn_format_ok']:.3f})"
                  if 'eval_format_ok' in log else ''))
