"""
What a run writes and reads back: per-episode numbers and their means, checkpoints, metrics.jsonl,
the curves PNG, the optional TensorBoard / Weights & Biases mirror, rollout dumps for sample.py,
progress lines and the summary printed at the end. Nothing here changes a number the trainer computes.
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

from gym import TRUNCATED, fail

CURVES = 'curves.png'        # file names inside out_dir
EPISODES = 'episodes.html'

# -----------------------------------------------------------------------------
# episode numbers


def summarise(t):
    """The numbers of one episode that metrics need (small, so ranks can exchange them)."""
    keys = ('em', 'f1', 'k', 'tt', 'pt', 'ht', 'n_turns', 'mem_quality', 'n_invalid', 'format_ok')
    return dict(reward=t.reward, success=bool(t.info.get('success')), stop=t.info.get('stop'), valid=t.valid,
                **{k: t.info[k] for k in keys if k in t.info})


def episode_metrics(eps, prefix=''):
    """Means over episode summaries; memory gyms add EM/F1/TT/PT overall and per objective count k, and
    the memory gym mem_quality (gyms/memory.py memory_quality, the mean over the episodes that have one).
    Format, for gyms whose env reports format_ok (the <mem> turn format): format_ok, the fraction of
    episodes whose every turn keeps the format and that end in an answer (an episode cut by the
    rollout, which has no format_ok, counts as not ok), and turn_format_ok, the fraction of turns that
    are well formed (1 - n_invalid / n_turns over the episodes whose info counts invalid turns)."""
    n = max(len(eps), 1)
    out = {f'{prefix}reward_mean': sum(e['reward'] for e in eps) / n,
           f'{prefix}success_rate': sum(e['success'] for e in eps) / n,
           f'{prefix}truncation_rate': sum(e['stop'] in TRUNCATED for e in eps) / n,  # out of turns or context
           f'{prefix}tt': sum(e.get('tt', 0) for e in eps) / n,  # tokens processed per episode
           f'{prefix}pt': sum(e.get('pt', 0) for e in eps) / n}  # mean over episodes of the peak context
    if any('format_ok' in e for e in eps):  # the <mem> turn-format gyms (memory, searchqa)
        out[f'{prefix}format_ok'] = sum(bool(e.get('format_ok')) for e in eps) / n
        counted = [e for e in eps if 'n_invalid' in e]
        out[f'{prefix}turn_format_ok'] = 1 - sum(e['n_invalid'] for e in counted) / max(sum(e['n_turns'] for e in counted), 1)
    if eps and 'em' in eps[0]:
        by_k = {}
        for e in eps:
            by_k.setdefault(e.get('k', 1), []).append(e)
        for suffix, es in [('', eps)] + [(f'_k{k}', v) for k, v in sorted(by_k.items())]:
            for key in ('em', 'f1', 'tt', 'pt', 'ht'):  # ht: the full history of the same episodes
                out[f'{prefix}{key}{suffix}'] = sum(float(e.get(key, 0.0)) for e in es) / len(es)
            quality = [e['mem_quality'] for e in es if e.get('mem_quality') is not None]  # memory gym
            if quality:
                out[f'{prefix}mem_quality{suffix}'] = sum(quality) / len(quality)
    return out


# -----------------------------------------------------------------------------
# checkpoints: one dict (model, optimizer, step, config, RNG states, reference, vocabulary)


CHECKPOINTS = 'ckpt_' + '[0-9]' * 6 + '.pt'  # the glob of this project's checkpoints: never a user's ckpt_best.pt


def save_checkpoint(state, out_dir, step, keep):
    """Write ckpt_<step>.pt atomically (temporary file, then rename) and keep the newest `keep` up to
    this step. A checkpoint of a later step is neither counted nor removed: it would otherwise push out
    the one just written (a resume renames those it skipped as corrupt to *.corrupt)."""
    path = os.path.join(out_dir, f'ckpt_{step:06d}.pt')
    tmp = path + '.tmp'
    torch.save(state, tmp)
    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    mine = [p for p in sorted(glob.glob(os.path.join(out_dir, CHECKPOINTS))) if p <= path]  # zero-padded names
    for old in mine[:-keep]:
        os.remove(old)
    return path


def load_latest_checkpoint(out_dir, if_all_corrupt):
    """The newest checkpoint in out_dir that loads; a corrupt one is reported and skipped.
    Returns (state, path) or (None, None) when there is none. When there are checkpoints but none
    loads, exits 2 with one line ending in the caller's advice `if_all_corrupt`: nothing is deleted."""
    paths = sorted(glob.glob(os.path.join(out_dir, CHECKPOINTS)), reverse=True)
    for path in paths:
        try:
            state = torch.load(path, map_location='cpu', weights_only=False)
            if not isinstance(state, dict) or not {'model', 'step', 'config'} <= set(state):
                raise ValueError('not a nanoagent checkpoint')
            return state, path
        except Exception as e:
            print(f'checkpoint {path} is corrupt ({type(e).__name__}); trying the previous one', file=sys.stderr)
    if paths:
        fail(f"no checkpoint in {out_dir} loads (all corrupt, see above); move them away or {if_all_corrupt}")
    return None, None


MODEL_SHAPE = ('n_layer', 'n_head', 'n_embd', 'max_len')  # config keys that size the tiny model


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
    ('KL to reference', ['kl'], False),
    ('entropy (nats / policy token)', ['entropy'], False),
    ('clip fraction', ['clip_frac'], False),
    ('truncation rate', ['truncation_rate', 'eval_truncation_rate'], False),
    ('context per episode (tokens)', ['tt', 'pt', 'eval_tt', 'eval_pt'], False),  # tt processed, pt peak
    ('logp_gap_max (sampler vs trainer)', ['logp_gap_max'], True),
    ('turns per episode', ['turns_mean'], False),
]


def read_metrics(path):
    """metrics.jsonl -> list of dicts; a half-written last line (a run killed mid-write) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
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


def run_summary(out_dir, cfg, wall_s):
    """A few lines for the end of a run: steps, wall time, tokens processed, best held-out (and
    validation) score,
    the paths of the newest checkpoint, metrics and curves (marked when missing), and the command
    that shows the policy's episodes."""
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
    for key in ('eval_success_rate', 'eval_greedy_success', 'eval_val_success'):  # choose on validation
        pts = [(r[key], r['step']) for r in rows if _number(r.get(key))]
        if pts:
            best, at = max(pts, key=lambda p: (p[0], -p[1]))
            lines.append(f"  best {key:<20} {best:.3f} at step {at} (step 0: {pts[0][0]:.3f}, last: {pts[-1][0]:.3f})")
    base = {k[len('eval_baseline_'):]: v for r in rows for k, v in r.items() if k.startswith('eval_baseline_')}
    if base:
        lines.append('  baselines    ' + ', '.join(f'{k} {v:.3f}' for k, v in sorted(base.items())))
    ckpts = sorted(glob.glob(os.path.join(out_dir, CHECKPOINTS)))
    last = os.path.join(out_dir, f'ckpt_{steps:06d}.pt')  # this run's last save, not a stray newer-named file
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
