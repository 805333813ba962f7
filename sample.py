"""
Run a policy on tasks and look at what it did: episodes as text, one HTML page with every token
coloured by owner, the training curves as a PNG, and the summary train.py prints at the end.

    python sample.py --out_dir=out                          # newest checkpoint, 4 held-out episodes
    python sample.py --out_dir=out --n=8 --greedy --html=episodes.html
    python sample.py config/tiny.yaml --untrained --html=untrained.html   # config only, random weights
    python sample.py --metrics_rollout=out/rollout_000050.pt --html=step50.html  # a training batch + advantages
    python sample.py --out_dir=out --curves=curves.png      # plot out/metrics.jsonl

Flags of this script: --split=heldout|train --n=4 --html=FILE --greedy --untrained --metrics_rollout=FILE
--curves=FILE. Every other argument (a YAML file, --key=value) goes to train.py's config, on top of
the checkpoint's own config when there is one.

Simplifications, on purpose:
1. The HTML page is static: inline CSS, one <span> per token, no JavaScript. Hovering a token shows
   its position, id, turn and sampling log-prob in the browser's own tooltip.
2. A token's text is decode([id]) on its own: a Hugging Face byte-level piece that is half of a
   character shows as a replacement character.
3. TensorBoard and wandb are optional and only mirror metrics.jsonl, which stays the record.
"""

import dataclasses
import glob
import html
import json
import os
import random
import sys

import torch

from model import load_policy
from rollout import OWNER, rollout_batch

OWNER_NAME = {v: k for k, v in OWNER.items()}
CURVES = 'curves.png'        # file names inside out_dir, shared with train.py and run_summary
EPISODES = 'episodes.html'

# -----------------------------------------------------------------------------
# running episodes


def run_episodes(model, gym_, cfg, split='heldout', n=4, greedy=False, generator=None):
    """n episodes of `model` on tasks drawn (seeded by cfg['seed']) from the gym's split -> list of
    Trajectory. A generator of its own by default, so calling this from train.py leaves the
    training RNG untouched. Raises ValueError on an unknown split."""
    if split not in ('heldout', 'train'):
        raise ValueError(f"split must be 'heldout' or 'train', got {split!r}")
    pool = gym_['eval_tasks' if split == 'heldout' else 'train_tasks']
    rng = random.Random(cfg['seed'])
    tasks = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
    if generator is None:
        generator = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'])
    model.eval()
    with torch.no_grad():
        return rollout_batch(model, gym_['fmt'], [gym_['make_env']() for _ in tasks], tasks, cfg,
                             generator=generator, temperature=0.0 if greedy else None)


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
# episodes as text


def _decoder(tok):
    """decode(ids) -> str from a tokenizer (anything with .decode), a callable, or an itos list."""
    if hasattr(tok, 'decode'):
        return tok.decode
    if callable(tok):
        return tok
    return lambda ids: ' '.join(tok[i] for i in ids)


def _task_id(task):
    return task.get('id') if isinstance(task, dict) else getattr(task, 'id', None)


def print_episode(traj, tok, file=None):
    """Print one Trajectory turn by turn: the prompt; per turn the context length the policy saw
    (after folding), its <mem> (memory gyms), the rest of its response, the observation; then
    reward and stop reason. tok: tokenizer with .decode, a decode callable, or an itos list."""
    decode = _decoder(tok)
    ids, owner, turn = traj.ids.tolist(), traj.owner.tolist(), traj.turn.tolist()
    out = [f"=== task {_task_id(traj.task)} · group {traj.group} · {len(ids)} tokens",
           f"prompt ({traj.prompt_len} tokens): {decode(ids[:traj.prompt_len])}"]
    for t, tr in enumerate(traj.turns):
        r, m = tr['response'], tr.get('mem_len', 0)
        out.append(f"--- turn {t + 1} · context {len(tr['context'][0])} tokens · response {len(r)} tokens")
        if m:
            out.append(f"  mem:    {decode(r[:m])}")
        out.append(f"  policy: {decode(r[m:])}")
        obs = [i for i, o, k in zip(ids, owner, turn) if k == t and o == OWNER['tool']]
        if obs:
            out.append(f"  obs:    {decode(obs)}")
    info = traj.info
    out.append(f"reward {traj.reward:g} · stop {info.get('stop')} · success {info.get('success')} · "
               f"turns {info.get('n_turns')} · invalid calls {info.get('n_invalid', 0)} · "
               f"tokens processed {info.get('tt')} · peak context {info.get('pt')}"
               + ('' if traj.valid else f" · INVALID {info.get('error', '')}"))
    print('\n'.join(out), file=file or sys.stdout)


# -----------------------------------------------------------------------------
# episodes as one HTML page

CSS = """
body { font: 13px/1.35 system-ui, sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 18px; margin: 0 0 6px; } h2 { font-size: 14px; margin: 0 0 6px; }
.legend { margin: 0 0 12px; } .legend .tok { vertical-align: middle; }
.episode { border: 1px solid #bbb; border-radius: 6px; padding: 8px 10px; margin: 0 0 14px; }
.ok { color: #1a7f37; } .fail { color: #b42318; }
.turn { display: flex; align-items: flex-start; border-top: 1px dotted #ddd; padding: 3px 0; }
.label { flex: 0 0 78px; color: #666; font-size: 11px; padding-top: 3px; }
.toks { display: flex; flex-wrap: wrap; gap: 2px; }
.tok { display: inline-flex; flex-direction: column; align-items: center; min-width: 14px;
       border: 2px solid; border-radius: 3px; padding: 0 3px; font: 12px/1.25 ui-monospace, monospace; }
.tok b { font-weight: normal; white-space: pre; }
.tok i { font-style: normal; font-size: 9px; color: #999; }
.tok i.m1 { color: #1a7f37; font-weight: bold; }
.tok i.adv { font-size: 9px; } .tok i.pos { color: #1a7f37; } .tok i.neg { color: #b42318; }
.o-template { border-color: #9aa0a6; background: #f1f3f4; color: #555; }
.o-prompt { border-color: #1a73e8; background: #e8f0fe; }
.o-policy { border-color: #1e8e3e; background: #e6f4ea; }
.o-tool { border-color: #e37400; background: #fef7e0; }
.tok.mem { background: #fff176; box-shadow: 0 0 0 1px #f9a825 inset; }
"""


def _cell(pos, tid, text, owner, mask, turn, mem, adv, logp):
    """One token as a <span> with machine-readable attributes; mask/mem/adv are None at position 0,
    which no column of the [T-1] tensors scores."""
    name = OWNER_NAME.get(owner, str(owner))
    m = '' if mask is None else str(int(mask))
    cls = f'tok o-{name}' + (' mem' if mem else '')
    attrs = (f'data-pos="{pos}" data-id="{tid}" data-owner="{name}" data-mask="{m}" data-turn="{turn}" '
             f'data-mem="{int(bool(mem))}"')
    tip = f'pos {pos} · id {tid} · {name} · ' + (f'turn {turn + 1}' if turn >= 0 else 'prompt') + (f' · logp {logp:.4f}' if mask else '')
    below = f'<i class="m{m}">{m or "&nbsp;"}</i>'
    if adv is not None:
        attrs += f' data-adv="{adv:.6g}"'
        tip += f' · adv {adv:+.4f}'
        if mask:
            below += f'<i class="adv {"pos" if adv >= 0 else "neg"}">{adv:+.2f}</i>'
    shown = text.replace('\n', '\\n') if text.strip() else repr(text)[1:-1] or '∅'
    return f'<span class="{cls}" {attrs} title="{html.escape(tip)}"><b>{html.escape(shown)}</b>{below}</span>'


def _episode_html(k, t, decode, adv):
    ids, owner, turn = t.ids.tolist(), t.owner.tolist(), t.turn.tolist()
    mask, mem, logp = t.action_mask.tolist(), t.mem_mask.tolist(), t.sample_logp.tolist()
    info = t.info
    ok = 'ok' if info.get('success') else 'fail'
    head = (f'episode {k} · task {html.escape(str(_task_id(t.task)))} · <span class="{ok}">reward '
            f'{t.reward:g} · stop {html.escape(str(info.get("stop")))}</span> · {info.get("n_turns")} turns · '
            f'{len(ids)} tokens · processed {info.get("tt")} · peak context {info.get("pt")}'
            + ('' if t.valid else ' · <span class="fail">INVALID</span>'))
    parts = [f'<section class="episode" data-episode="{k}" data-reward="{t.reward:g}" '
             f'data-stop="{html.escape(str(info.get("stop")))}"><h2>{head}</h2>']
    row = None
    for j, tid in enumerate(ids):
        if turn[j] != row:  # one line per turn: the prompt, then each policy turn with its observation
            if row is not None:
                parts.append('</div></div>')
            row = turn[j]
            label = 'prompt' if row < 0 else f'turn {row + 1}<br>context {len(t.turns[row]["context"][0])}'
            parts.append(f'<div class="turn"><div class="label">{label}</div><div class="toks">')
        s = j - 1  # the [T-1] tensors' column that scores token j
        parts.append(_cell(j, tid, decode([tid]), owner[j], mask[s] if j else None, turn[j],
                           mem[s] if j else 0, float(adv[s]) if adv is not None and j else None,
                           logp[s] if j else 0.0))
    parts.append('</div></div></section>')
    return ''.join(parts)


def render_html(trajs, tok, advantages=None, title='nanoagent episodes'):
    """One self-contained HTML page (inline CSS, no scripts, nothing fetched) showing trajectories
    token by token. Every token is a cell bordered by its owner, with data-pos, data-id, data-owner
    (template/prompt/policy/tool), data-mask (action_mask[pos-1]; empty at pos 0), data-turn,
    data-mem (mem_mask[pos-1]: a sampled <mem> span, highlighted) and, given advantages (a list of
    [T-1] per trajectory), data-adv. tok: tokenizer with .decode, a decode callable, or itos."""
    decode = _decoder(tok)
    legend = ''.join(f'<span class="tok o-{n}"><b>{n}</b><i>&nbsp;</i></span> ' for n in OWNER)
    legend += ('<span class="tok o-policy mem"><b>&lt;mem&gt; span</b><i>&nbsp;</i></span> '
               '&nbsp; under each token: its action mask (1 = a trained policy token)'
               + (', then its advantage' if advantages is not None else '') + '; hover for id and log-prob')
    body = [_episode_html(k, t, decode, None if advantages is None else advantages[k]) for k, t in enumerate(trajs)]
    return (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<style>{CSS}</style></head>\n<body><h1>{html.escape(title)}</h1><div class="legend">{legend}</div>\n'
            + '\n'.join(body) + '\n</body></html>\n')


def write_html(path, trajs, tok, advantages=None, title='nanoagent episodes'):
    with open(path, 'w', encoding='utf-8') as f:
        f.write(render_html(trajs, tok, advantages, title))
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
    """A few lines for the end of a run: steps, wall time, tokens processed, best held-out score,
    and the paths of the newest checkpoint, metrics, curves and episode page (marked when missing)."""
    metrics = os.path.join(out_dir, 'metrics.jsonl')
    rows = read_metrics(metrics) if os.path.exists(metrics) else []
    steps = max((r['step'] for r in rows), default=0)
    # tokens: every turn's context plus its response; step lines carry it as tokens or tokens_per_s x step_time_s
    tokens = sum(r['tokens'] if _number(r.get('tokens')) else r.get('tokens_per_s', 0) * r.get('step_time_s', 0)
                 for r in rows if r['step'] > 0)
    lines = [f"run summary: gym {cfg.get('gym')}, model {cfg.get('model')}",
             f"  steps        {steps} / {cfg.get('steps')}",
             f"  wall time    {int(wall_s // 60)}m {wall_s % 60:.0f}s",
             f"  tokens       {tokens / 1e6:.2f}M processed (contexts + responses, RL steps)"]
    for key in ('eval_success_rate', 'eval_greedy_success'):
        pts = [(r[key], r['step']) for r in rows if _number(r.get(key))]
        if pts:
            best, at = max(pts, key=lambda p: (p[0], -p[1]))
            lines.append(f"  best {key:<20} {best:.3f} at step {at} (step 0: {pts[0][0]:.3f}, last: {pts[-1][0]:.3f})")
    base = {k[len('eval_baseline_'):]: v for r in rows for k, v in r.items() if k.startswith('eval_baseline_')}
    if base:
        lines.append('  baselines    ' + ', '.join(f'{k} {v:.3f}' for k, v in sorted(base.items())))
    ckpts = sorted(glob.glob(os.path.join(out_dir, 'ckpt_*.pt')))
    for name, path in [('checkpoint', ckpts[-1] if ckpts else os.path.join(out_dir, 'ckpt_*.pt')),
                       ('metrics', metrics), ('curves', os.path.join(out_dir, CURVES)),
                       ('episodes', os.path.join(out_dir, EPISODES))]:
        lines.append(f"  {name:<12} {path}" + ('' if os.path.exists(path) else '  (missing)'))
    return '\n'.join(lines)


# -----------------------------------------------------------------------------


def parse_args(argv, defaults=None):
    """Split argv into this script's options (`defaults`: their names and default values; evaluate.py
    passes its own) and the rest (train.py's config arguments)."""
    import train
    opts = dict(defaults or dict(split='heldout', n=4, html='', greedy=False, untrained=False, metrics_rollout='',
                                 curves=''))
    rest = []
    for arg in argv:
        key, eq, raw = arg[2:].partition('=')
        if not arg.startswith('--') or key not in opts:
            rest.append(arg)
        elif not eq and isinstance(opts[key], bool):
            opts[key] = True  # a bare --greedy / --untrained
        else:
            opts[key] = train.check_key(key, train.parse_value(key, raw, opts[key]), opts)
    if opts.get('split', 'heldout') not in ('heldout', 'train'):
        train.fail(f"--split must be heldout or train, got {opts['split']!r}")
    if 'n' in opts and opts['n'] < 1:
        train.fail(f"--n must be >= 1, got {opts['n']}")
    for key in ('html', 'curves'):  # before any episode runs, not after
        folder = os.path.dirname(opts.get(key) or '.') or '.'
        if not os.path.isdir(folder):
            train.fail(f"--{key}={opts[key]}: folder {folder} does not exist")
    return opts, rest


def load_run(rest, untrained=False):
    """(cfg, gym_, model, description) for train.py config arguments `rest` (YAML files, --key=value):
    the newest checkpoint in cfg['out_dir'], built from the checkpoint's own config with `rest` on top,
    or, with untrained=True or no checkpoint there, the policy cfg['model'] as train.py would build it
    before training. A CUDA config falls back to the CPU when there is no GPU. Shared with evaluate.py."""
    import train  # here, not at the top: train.py imports this file for its plots and summary
    cfg = train.load_config(rest)
    state, path = (None, None) if untrained else train.load_latest_checkpoint(cfg['out_dir'])
    if state is None and not untrained and any(a.startswith('--out_dir=') for a in rest):
        # a run directory named on the command line must hold a run: a typo must not quietly give
        # numbers of an untrained policy
        train.fail(f"no checkpoint in {cfg['out_dir']} (add --untrained to run the untrained policy)")
    if state is not None:  # the checkpoint's config builds the gym and the model; argv still overrides
        cfg = train.load_config(rest, dict(train.config, **state['config']))
    if cfg['device'].startswith('cuda') and not torch.cuda.is_available():
        print('no CUDA here: running on cpu')
        cfg['device'] = 'cpu'
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    torch.manual_seed(cfg['seed'])  # the untrained model's weights, as train.py would draw them
    gym_ = train.setup_gym(cfg)
    try:
        model = load_policy(cfg, gym_['tok'].vocab_size)
    except OSError as e:
        train.fail(str(e))
    if state is not None:
        model.load_state_dict(state['model'])
    policy = f"{os.path.basename(path)} (step {state['step']})" if state is not None else \
        f"untrained {cfg['model']} ({'--untrained' if untrained else 'no checkpoint in ' + cfg['out_dir']})"
    print(f'policy: {policy}')
    return cfg, gym_, model, policy


def main(argv):
    import train
    opts, rest = parse_args(argv)
    cfg = train.load_config(rest)
    if opts['curves'] and not os.path.isfile(os.path.join(cfg['out_dir'], 'metrics.jsonl')):
        train.fail(f"--curves: no metrics.jsonl in {cfg['out_dir']}")
    advantages = None
    if opts['metrics_rollout']:
        if not os.path.isfile(opts['metrics_rollout']):
            train.fail(f"no rollout dump {opts['metrics_rollout']} (a run writes them with dump_rollouts: true)")
        try:
            dump = torch.load(opts['metrics_rollout'], map_location='cpu', weights_only=False)  # our own file
            dump['trajs'], dump['advantages'], dump['config'], dump['step']
        except Exception as e:  # a metrics file, a checkpoint, a torn file
            train.fail(f"--metrics_rollout={opts['metrics_rollout']} is not a rollout dump (rollout_*.pt): "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        cfg = train.load_config(rest, dict(train.config, **dump['config']))
        gym_ = train.setup_gym(cfg)
        trajs, advantages = dump['trajs'], dump['advantages']
        title = f"{cfg['gym']} · training batch of step {dump['step']} ({os.path.basename(opts['metrics_rollout'])})"
        print(f"rollout dump {opts['metrics_rollout']}: step {dump['step']}, {len(trajs)} episodes")
    else:
        cfg, gym_, model, policy = load_run(rest, opts['untrained'])
        title = f"{cfg['gym']} · {policy} · {opts['split']} · {'greedy' if opts['greedy'] else 'sampled'}"
        trajs = run_episodes(model, gym_, cfg, opts['split'], opts['n'], opts['greedy'])
    for t in trajs:
        print_episode(t, gym_['tok'])
    n = len(trajs)
    print(f"{n} episodes: mean reward {sum(t.reward for t in trajs) / n:.3f}, "
          f"success {sum(bool(t.info.get('success')) for t in trajs) / n:.3f}")
    if opts['html']:
        print('wrote', write_html(opts['html'], trajs, gym_['tok'], advantages, 'nanoagent · ' + title))
    if opts['curves']:
        png = plot_metrics(os.path.join(cfg['out_dir'], 'metrics.jsonl'), opts['curves'])
        if png:
            print('wrote', png)


if __name__ == '__main__':
    main(sys.argv[1:])
