"""
Look at a policy: episodes as text, one HTML page with every token coloured by owner, the training
curves as a PNG, and held-out evaluation (--eval) with the numbers train.py logs.

    python sample.py --out_dir=out/tiny                         # newest checkpoint, 4 held-out episodes
    python sample.py --out_dir=out/tiny --n=8 --greedy --html=episodes.html
    python sample.py config/tiny.yaml --untrained --html=untrained.html   # config only, random weights
    python sample.py --metrics_rollout=out/tiny/rollout_000150.pt --html=step150.html  # a training batch + advantages
    python sample.py --out_dir=out/tiny --curves=curves.png     # plot out/tiny/metrics.jsonl
    python sample.py --out_dir=out/tiny --eval                  # every held-out task, greedy
    python sample.py config/smollm2_hotpotqa.yaml --eval --eval_tasks=50 --untrained   # zero-shot
    python sample.py config/smollm2_memory.yaml --eval --scripted   # the warm start's scripted policy
    python sample.py --out_dir=out/q --eval --sampled --json=eval.json   # the run's eval_samples per task
    python sample.py --ckpt=out/q/ckpt_000000.pt --eval --split=val --json=step0.json   # one checkpoint

Flags of this script: --split=heldout|train|val --n=4 --html=FILE --greedy --untrained --scripted
--ckpt=FILE (this checkpoint, not out_dir's newest) --metrics_rollout=FILE --curves=FILE;
with --eval: --sampled (eval_samples episodes per task at the config's temperature, as train.py;
default greedy, one per task), --batch=512 (episodes per rollout batch), --show=2 (episodes printed),
--json=FILE (the numbers and each episode's outcome). A checkpoint's --eval samples from the generator
train.py's evaluation used at its step, in train.py's batches: greedy prints the run's eval_greedy_success
(and compares its invalid episodes with eval_greedy_invalid_episodes),
and --sampled its eval_success_rate and other eval_* numbers (eval_val_* with --split=val); a line
after them gives the numbers the run logged (its metrics.jsonl), whether they are the same, and the
settings that differ from the run's evaluation (JSON: `logged`). Another
--batch or --eval_samples changes sampled numbers, and bf16 greedy ones a little; a run on several
processes (torchrun) evaluated each process's share of the tasks, so its sampled numbers differ.
Every other argument (a YAML file, --key=value)
is train.py's config, on top of the checkpoint's own config when out_dir holds one (eval_tasks = how
many held-out tasks, and of training ones with --split=train, 0 = all);
a training key (config.TRAINING_KEYS: --steps, --lr, ...) is refused, as it would change nothing.

Simplifications, on purpose:
1. The HTML page is static: inline CSS, one <span> per token, no JavaScript. Hovering a token shows
   its position, id, turn and sampling log-prob in the browser's own tooltip.
2. A token's text is decode([id]) on its own: a Hugging Face byte-level piece that is half of a
   character shows as a replacement character.
3. Evaluation runs one rollout batch at a time, no sharding over processes.
"""

import html
import json
import os
import random
import signal
import sys
import time
from collections import Counter

import torch
from tqdm import tqdm

import report
from config import (SCRIPTED_KEYS, TRAINING_KEYS, config, fail, load_config, load_saved_config, parse_options, read_config_file,
                    resolve_dtype)
from gym import OWNER, TRUNCATED, GymContractError, OutOfVocabulary, gym_module, load_gym
from model import load_policy
from rollout import EVAL_EPISODES_PER_BATCH, EVAL_PREFIX, SPLIT_NAMES, eval_generator, run_tasks

OWNER_NAME = {v: k for k, v in OWNER.items()}
OPTIONS = dict(split='heldout', n=4, html='', greedy=False, untrained=False, scripted=False, metrics_rollout='', curves='',
               eval=False, sampled=False, batch=EVAL_EPISODES_PER_BATCH, show=2, json='', ckpt='')

# -----------------------------------------------------------------------------
# running episodes


SPLITS = {'heldout': 'eval_tasks', 'train': 'train_tasks', 'val': 'val_tasks'}  # --split -> the gym's tasks
# keys an evaluation of a checkpoint does not read: where it is, how it was trained, the scripted policy's mistakes
NOT_EVALUATION_KEYS = ('out_dir', 'device', *TRAINING_KEYS, *SCRIPTED_KEYS)


def split_tasks(gym_, split, cfg):
    """The tasks of split 'heldout', 'train' or 'val' (val_tasks, of a gym whose KEYS has it); exits 2
    with one line when the gym has none."""
    if not gym_.get(SPLITS.get(split)):
        if split == 'val' and 'val_tasks' not in gym_module(cfg).KEYS:
            fail(f"--split=val: gym {cfg['gym']!r} has no validation split")
        fail(f"--split={split}: the gym has no such tasks" + (' (set --val_tasks=N)' if split == 'val' else ''))
    return gym_[SPLITS[split]]


def policy_for(model, n, rng):
    """What run_tasks rolls out for n episodes: the model itself, or, for the gym's scripted policy
    (load_run with scripted=True gives its gym_['warm_policy'], a function rng -> policy), n copies of it."""
    return model if isinstance(model, torch.nn.Module) else [model(rng) for _ in range(n)]


def run_episodes(model, gym_, cfg, split='heldout', n=4, greedy=False, generator=None):
    """n episodes of `model` (or of the scripted policy, see policy_for) on tasks drawn (seeded by
    cfg['seed']) from the gym's split -> list of Trajectory. A generator of its own by default, so the
    caller's RNG streams stay untouched. Exits 2 on a split the gym does not have."""
    pool = split_tasks(gym_, split, cfg)
    if n > len(pool):
        print(f"note: --n={n} is more than the {len(pool)} {split} tasks, so tasks repeat (each once before any twice)")
    rng = random.Random(cfg['seed'])
    order = rng.sample(pool, min(n, len(pool)))
    tasks = [order[i % len(order)] for i in range(n)]
    if generator is None:
        generator = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'])
    with torch.no_grad():
        return run_tasks(policy_for(model, n, rng), gym_, cfg, tasks, generator=generator,
                         temperature=0.0 if greedy else None)


@torch.no_grad()
def evaluate(model, gym_, cfg, samples=1, greedy=True, batch=EVAL_EPISODES_PER_BATCH, split='heldout', step=0):
    """Every task of gym_'s split (held-out by default), `samples` times, `batch` episodes per rollout batch. Returns
    (metrics dict, trajectories): train.py's episode metrics (format validity among them) plus turns,
    invalid turns and stop reasons. Sampling draws from the generator train.py's evaluation at training step
    `step` draws from (rollout.eval_generator), and the default batch is train.py's: a checkpoint of that
    step gives the numbers its run logged (greedy: eval_greedy_success; samples=eval_samples, greedy=False:
    eval_success_rate and the other eval_* metrics; eval_val_* with split='val'). The training split: its
    first cfg['eval_tasks'] tasks (all when 0)."""
    tasks, rng = split_tasks(gym_, split, cfg), random.Random(cfg['seed'])
    if split == 'train' and cfg['eval_tasks']:  # thousands of them: the first eval_tasks, as many as held-out
        tasks = tasks[:cfg['eval_tasks']]
    gen = eval_generator(cfg, SPLITS[split], step)
    per = max(1, batch // samples)  # tasks per rollout batch; a task's samples stay together
    trajs = []
    for i in tqdm(range(0, len(tasks), per), desc='eval', unit='batch', leave=False, disable=not sys.stderr.isatty()):
        chunk = tasks[i:i + per]
        trajs += run_tasks(policy_for(model, len(chunk) * samples, rng), gym_, cfg, chunk, samples, generator=gen,
                           temperature=0.0 if greedy else None)
    decoding = 'scripted' if not isinstance(model, torch.nn.Module) else 'greedy' if greedy else 'sampled'
    report.check_invalid(trajs, f"evaluation ({SPLIT_NAMES[SPLITS[split]]}, {decoding})")  # as train.py's: warn, or stop
    n = max(len(trajs), 1)
    out = dict(episodes=len(trajs), **report.episode_metrics([report.summarise(t) for t in trajs]),
               turns_mean=sum(len(t.turns) for t in trajs) / n,
               invalid_turns_mean=sum(t.info.get('n_invalid', 0) for t in trajs) / n,
               stops=dict(Counter(str(t.info.get('stop')) for t in trajs)))
    return out, trajs


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
    """A task's id, or the task itself when it is a plain number or string (the example gym's secret)."""
    if isinstance(task, dict):
        return task.get('id')
    return getattr(task, 'id', task if isinstance(task, (int, str)) else None)


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
            + ('' if t.valid else f' · <span class="fail">INVALID {html.escape(str(info.get("error", "")))}</span>'))
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


def parse_args(argv, defaults=OPTIONS):
    """Split argv into this script's options (`defaults`: names and default values) and the rest
    (train.py's config arguments). Exits 2 with one line on a bad option."""
    if any(a.partition('=')[0] == '--samples' for a in argv):  # sampled episodes per task are the config's, as in train.py
        fail("--samples: --sampled rolls out the config's eval_samples episodes per task; set --eval_samples=N")
    opts, rest = parse_options(argv, defaults)
    for key in [a[2:].partition('=')[0] for a in rest if a.startswith('--')]:
        if key in TRAINING_KEYS:  # it would be ignored
            fail(f"--{key} is a training key (config.py); sample.py runs a saved policy and does not read it: drop it")
    if opts['split'] not in SPLITS:
        fail(f"--split must be {', '.join(SPLITS)}, got {opts['split']!r}")
    for key in ('n', 'batch'):
        if opts[key] < 1:
            fail(f"--{key} must be >= 1, got {opts[key]}")
    if opts['show'] < 0:
        fail(f"--show must be >= 0, got {opts['show']}")
    if opts['scripted'] and (opts['untrained'] or opts['metrics_rollout']):
        fail(f"--scripted runs the gym's scripted policy, not a model: drop --{'untrained' if opts['untrained'] else 'metrics_rollout'}")
    clash = [k for k in ('untrained', 'scripted', 'metrics_rollout', 'curves') if opts['ckpt'] and opts[k]]
    if clash:  # they run no checkpoint, so --ckpt would be ignored
        fail(f"--ckpt does nothing with --{clash[0]}: drop one of them")
    if os.path.isdir(opts['ckpt']):
        fail(f"--ckpt={opts['ckpt']} is a folder: --out_dir={opts['ckpt']} runs its newest checkpoint")
    if opts['ckpt'] and any(a.partition('=')[0] == '--out_dir' for a in rest):  # the file names its run
        fail(f"--out_dir does nothing with --ckpt={opts['ckpt']}: drop one of them")
    if opts['ckpt'] and not os.path.isfile(opts['ckpt']):
        fail(f"--ckpt={opts['ckpt']}: no such file (a run's checkpoints are out_dir/ckpt_<step>.pt)")
    for key, others in (('metrics_rollout', ('eval', 'untrained', 'split', 'n', 'greedy', 'curves')), ('eval', ('curves', 'n', 'greedy'))):
        clash = [k for k in others if opts[key] and opts[k] != defaults[k]]  # they would be ignored
        if clash:
            fail(f"--{clash[0]} does nothing with --{key}: drop one of them")
    eval_only = [k for k in ('sampled', 'batch', 'show', 'json') if opts[k] != defaults[k]]
    if eval_only and not opts['eval']:  # they would be ignored
        fail(f"--{eval_only[0]} is an --eval flag; add --eval (--greedy is the episodes' own)")
    for key, ext in (('html', '.html'), ('curves', '.png'), ('json', '.json')):  # before any episode runs, not after
        folder = os.path.dirname(opts[key] or '.') or '.'
        if not os.path.isdir(folder):
            fail(f"--{key}={opts[key]}: folder {folder} does not exist")
        if opts[key] and not opts[key].endswith(ext):  # not a folder, a checkpoint or metrics.jsonl by mistake
            fail(f"--{key}={opts[key]}: expected a file name ending in {ext} (--{key}=out{ext})")
        if os.path.basename(opts[key]) == report.CONFIG:
            fail(f"--{key}={opts[key]}: config.json is the name of a run's saved config; choose another name")
    return opts, rest


def load_run(rest, untrained=False, scripted=False, split='heldout', ckpt=''):
    """(cfg, gym_, model, description) for train.py config arguments `rest` (YAML files, --key=value):
    the newest checkpoint in cfg['out_dir'] (or the file `ckpt`), built from the checkpoint's own
    config (and vocabulary) with `rest` on top, or, with untrained=True, the policy cfg['model'] as
    train.py would build it before training (from out_dir/config.json when the run wrote one, with
    `rest` on top), or, with scripted=True, no model: the gym's scripted policy gym_['warm_policy']
    (the config as untrained reads it), rendered in cfg['model']'s tokens. Exits 2 when there is no
    checkpoint that loads and neither is set, when `ckpt` is not a checkpoint, when the gym has no
    scripted policy or no tasks of split (before the model loads). A CUDA config falls back to the
    CPU without a GPU. Returns (cfg, gym_, model, description, ckpt): ckpt = dict(path, step, config) of
    the checkpoint, None without one."""
    untrained = untrained or scripted
    cfg = load_config(rest)
    saved = report.saved_config(cfg['out_dir']) if untrained else {}
    if saved:  # the run's gym and model, before its training
        cfg = load_saved_config(rest, saved)
        if any(cfg[k] != saved.get(k) for k in ('gym', 'model')):  # argv named another: not the run's config
            saved = {}
    state, path = None, None
    if ckpt:
        try:
            state, path = report.read_checkpoint(ckpt), ckpt
        except Exception as e:  # a torn file, metrics.jsonl, a rollout dump
            fail(f"--ckpt={ckpt} is not a nanoagent checkpoint ({type(e).__name__})")
    elif not untrained:
        state, path = report.load_latest_checkpoint(cfg['out_dir'], 'add --untrained')
    if state is None and not untrained:  # a typo, or no run yet, must not quietly give an untrained policy's numbers
        fail(f"no checkpoint in {cfg['out_dir']} (add --untrained to run the untrained policy)" if os.path.isdir(cfg['out_dir'])
             else f"no such folder: {cfg['out_dir']} (--out_dir names a run's folder; train first, or add --untrained or --scripted)")
    if state is not None:  # the checkpoint's config builds the gym and the model; argv still overrides
        cfg = load_saved_config(rest, state['config'])
        for key in ('gym', 'model'):  # the weights (and a tiny model's vocabulary) belong to these
            if cfg[key] != state['config'][key]:
                named = [a for a in rest if a.partition('=')[0] == f'--{key}'] or \
                    [a for a in rest if not a.startswith('-') and key in read_config_file(a, rest)]
                fail(f"{path} was trained with {key} {state['config'][key]!r}, not {cfg[key]!r} "
                     f"(drop {(named or [f'--{key}'])[-1]}: the checkpoint's own config is used where argv says nothing)")
    if cfg['device'].startswith('cuda') and not torch.cuda.is_available():
        print('no CUDA here: running on cpu')
        cfg['device'] = 'cpu'
    resolve_dtype(cfg)  # an untrained or scripted look at a dtype: auto config computes as train.py would
    if cfg['threads']:
        torch.set_num_threads(cfg['threads'])
    torch.manual_seed(cfg['seed'])  # the untrained model's weights, as train.py would draw them
    # --split=train: eval_tasks counts the training tasks evaluated (evaluate); the gym's held-out cut stays the run's
    own_cut = (state['config'] if state else saved).get('eval_tasks', 0)
    gym_ = load_gym(dict(cfg, eval_tasks=own_cut) if split == 'train' else cfg, state.get('vocab') if state else None, config)
    split_tasks(gym_, split, cfg)  # a split the gym lacks: refused before anything is printed or loaded
    if scripted:
        if gym_['warm_policy'] is None:
            fail(f"--scripted: gym {cfg['gym']!r} has no scripted policy")
        print(f"policy: the {cfg['gym']} gym's scripted policy (--scripted)")
        return cfg, gym_, gym_['warm_policy'], 'scripted policy (--scripted)', None
    try:
        model = load_policy(cfg, gym_['tok'].vocab_size)
    except OSError as e:
        fail(str(e))
    if state is not None:
        report.load_weights(model, state, cfg, path)
    policy = f"{path} (step {state['step']})" if state is not None else \
        f"untrained {cfg['model']} (--untrained{', the config of ' + os.path.join(cfg['out_dir'], report.CONFIG) if saved else ''})"
    print(f'policy: {policy}', flush=True)  # before a long evaluation, also in a pipe
    processes = len(state.get('rng', {}).get('gen', ())) if state is not None else 1  # train.py saves every rank's sampler
    if processes > 1:
        print(f"note: {path} comes from a run on {processes} processes, whose evaluations gave each process a share "
              "of the tasks and a random stream of its own: sampled numbers here differ from its log")
    return cfg, gym_, model, policy, None if state is None else dict(path=path, step=state['step'], config=state['config'])


def load_dump(path, rest):
    """(cfg, gym_, trajectories, advantages, title) of a rollout dump written by dump_rollouts: true."""
    if not os.path.isfile(path):
        fail(f"no rollout dump {path} (a run writes them with dump_rollouts: true)")
    try:
        dump = torch.load(path, map_location='cpu', weights_only=False)  # our own file
        dump['trajs'], dump['advantages'], dump['config'], dump['step']
    except Exception as e:  # a metrics file, a checkpoint, a torn file
        fail(f"--metrics_rollout={path} is not a rollout dump (rollout_*.pt): "
             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    cfg = load_config(rest, dict(config, **dump['config']))
    print(f"rollout dump {path}: step {dump['step']}, {len(dump['trajs'])} episodes")
    title = f"{cfg['gym']} · training batch of step {dump['step']} ({os.path.basename(path)})"
    return cfg, load_gym(cfg, None, config), dump['trajs'], dump['advantages'], title


def logged_numbers(ckpt, split, sampled):
    """What the run of checkpoint ckpt (load_run's dict) logged for this evaluation at the checkpoint's
    step, from the metrics.jsonl beside it, in evaluate()'s names: greedy {'success_rate': eval_greedy_success,
    'success_rate_k1': eval_greedy_success_k1, ..., 'invalid_episodes': eval_greedy_invalid_episodes},
    sampled every eval_* metric (eval_val_* for split 'val'). Returns (numbers, None), or (None, why not)."""
    metrics = os.path.join(os.path.dirname(ckpt['path']), 'metrics.jsonl')
    prefix = EVAL_PREFIX.get(SPLITS[split])
    if prefix is None:
        return None, 'train.py does not evaluate the training split'
    if not os.path.isfile(metrics):
        return None, f'no metrics.jsonl beside {ckpt["path"]}'
    rows = [r for r in report.read_metrics(metrics) if r.get('step') == ckpt['step'] and prefix + 'greedy_success' in r]
    if not rows and split == 'val' and not ckpt['config'].get('val_tasks'):
        return None, 'the run had no validation tasks (val_tasks 0)'
    if not rows:
        return None, (f"{metrics} has no evaluation of this split at step {ckpt['step']} (not evaluated: eval_every; "
                      "or its line is unreadable)")
    if not sampled:  # greedy_success and, on memory gyms, greedy_success_k1..; its invalid episodes where logged
        greedy, invalid, row = prefix + 'greedy_success', prefix + 'greedy_invalid_episodes', rows[-1]
        numbers = {'success_rate' + k[len(greedy):]: v for k, v in row.items() if k.startswith(greedy)}
        if invalid in row:  # logged by train.py since it counts greedy invalid episodes
            numbers['invalid_episodes'] = row[invalid]
        return numbers, None
    numbers = {k[len(prefix):]: v for k, v in rows[-1].items() if k.startswith(prefix)}
    if 'stop_truncated' in numbers:  # logged before the stops named their limit: its stop_max_turns was a gym's budget
        numbers = {k: v for k, v in numbers.items() if not k.startswith('stop_')}
    return numbers, None


def compare_with_log(numbers, ckpt, split, sampled, cfg, batch):
    """Print one line: the numbers this evaluation shares with the run's log at the checkpoint's step,
    whether they are the same, and the settings that differ from the run's evaluation (the config on top
    of the checkpoint's, --batch; a greedy one reads neither eval_samples nor temperature); or why
    there is nothing to compare. Returns what the JSON keeps:
    dict(numbers, same, differs_in), or dict(missing=why)."""
    logged, why = logged_numbers(ckpt, split, sampled)
    shared = {k: v for k, v in (logged or {}).items() if k in numbers and isinstance(v, (int, float))}
    if not shared:
        why = why or 'no number in common with the log'
        print(f"note: nothing logged to compare with: {why}")
        return dict(missing=why)
    differ = [k for k, v in shared.items() if numbers[k] != v]
    unread = () if sampled else ('eval_samples', 'temperature')  # greedy: one episode per task, no sampling
    settings = [f'{k} {ckpt["config"][k]!r} -> {v!r}' for k, v in cfg.items()
                if k not in NOT_EVALUATION_KEYS + unread and k in ckpt['config'] and ckpt['config'][k] != v]
    if batch != EVAL_EPISODES_PER_BATCH:
        settings.append(f'batch {EVAL_EPISODES_PER_BATCH} -> {batch} (--batch)')
    keys = differ[:4] or [k for k in ('success_rate', 'em', 'truncation_rate', 'turn_format_ok') if k in shared] \
        + ['invalid_episodes'] * bool(shared.get('invalid_episodes'))  # a broken env's count, said when there is one
    num = lambda v: f'{v:.3f}' if isinstance(v, float) else str(v)  # a count (invalid_episodes) stays a count
    shown = ', '.join(f'{k} {num(shared[k])}' + (f' (here {num(numbers[k])})' if k in differ else '') for k in keys)
    verdict = 'the same' if not differ else 'not the same'
    reason = ((', though' if not differ else ';') + ' this evaluation differs in: ' + '; '.join(settings) if settings else
              '' if not differ else ', with the same settings (rounding on another machine or torch build, or an edited log)')
    print(f"the run logged at step {ckpt['step']}: {shown}: {verdict}{reason}")
    return dict(numbers=shared, same=not differ, differs_in=settings)


def main_eval(opts, rest):
    """--eval: every task of --split (held-out by default); prints one line of numbers and their JSON, returns the dict."""
    t0 = time.time()
    cfg, gym_, model, policy, ckpt = load_run(rest, opts['untrained'], opts['scripted'], opts['split'], opts['ckpt'])
    step = ckpt['step'] if ckpt else 0
    samples = cfg['eval_samples'] if opts['sampled'] else 1  # greedy episodes of one task are all the same
    numbers, trajs = evaluate(model, gym_, cfg, samples, not opts['sampled'], opts['batch'], opts['split'], step)
    for t in trajs[:opts['show']]:
        print_episode(t, gym_['tok'])
    settings = {k: cfg[k] for k in ('gym', 'model', 'data', 'prompt_style', 'keep_tool_results', 'max_turns',
                                    'max_response_tokens', 'max_obs_tokens', 'max_len', 'enable_thinking')}
    decoding = 'scripted' if opts['scripted'] else 'sampled' if opts['sampled'] else 'greedy'
    result = dict(policy=policy, step=step, **settings, decoding=decoding,
                  temperature={'sampled': cfg['temperature'], 'greedy': 0.0}.get(decoding), split=opts['split'],
                  tasks=numbers['episodes'] // samples,
                  samples=samples, **numbers, wall_s=round(time.time() - t0, 1))
    keys = ['em', 'f1', 'success_rate', 'reward_mean', 'turns_mean', 'tt', 'pt', 'truncation_rate',
            *(f'stop_{why}' for why in TRUNCATED), 'format_ok', 'turn_format_ok', 'hop_share']  # stop_*: which limit cut
    keys += ['invalid_episodes'] if result['invalid_episodes'] else []  # a broken env: said only when it happened
    names = dict(tt='tokens processed per episode (tt)', pt='peak context (pt)')  # the JSON keeps the short keys
    print(f"{policy} on {result['tasks']} {SPLIT_NAMES[SPLITS[opts['split']]]} {cfg['gym']} tasks x {samples}, {result['decoding']}, "
          f"keep_tool_results={cfg['keep_tool_results']}: "
          + ', '.join(f'{names.get(k, k)} {result[k]:.3f}' if isinstance(result[k], float) else f'{names.get(k, k)} {result[k]}'
                      for k in keys if k in result))
    if ckpt:  # beside the run's own log, so a user sees whether it repeats
        result['logged'] = compare_with_log(numbers, ckpt, opts['split'], opts['sampled'], cfg, opts['batch'])
    print(json.dumps(result))
    if opts['json']:  # the file adds each episode's outcome, in task order, to compare two policies task by task
        episodes = [dict(task=_task_id(t.task), **{k: v for k, v in report.summarise(t).items() if k != 'mem_pairs'})
                    for t in trajs]
        with open(opts['json'], 'w') as f:
            json.dump(dict(result, per_episode=episodes), f, indent=1)
    if opts['html']:
        print('wrote', write_html(opts['html'], trajs, gym_['tok'], title=f"nanoagent · eval · {policy}"))
    return result


def main(argv):
    """The command line. A gym's mistake met while playing episodes (GymContractError, OutOfVocabulary)
    stops with one line, as in train.py."""
    try:
        return main_episodes(*parse_args(argv))
    except (OutOfVocabulary, GymContractError) as e:
        fail(str(e))


def main_episodes(opts, rest):
    if opts['eval']:
        return main_eval(opts, rest)
    cfg = load_config(rest)
    if opts['curves']:  # only the plot: no policy, no episodes
        metrics = os.path.join(cfg['out_dir'], 'metrics.jsonl')
        if not os.path.isfile(metrics):
            fail(f"--curves: no metrics.jsonl in {cfg['out_dir']}")
        png = report.plot_metrics(metrics, opts['curves'])
        return print('wrote', png) if png else None
    advantages = None
    if opts['metrics_rollout']:
        cfg, gym_, trajs, advantages, title = load_dump(opts['metrics_rollout'], rest)
    else:
        cfg, gym_, model, policy, _ = load_run(rest, opts['untrained'], opts['scripted'], opts['split'], opts['ckpt'])
        title = f"{cfg['gym']} · {policy} · {opts['split']} · {'greedy' if opts['greedy'] else 'sampled'}"
        trajs = run_episodes(model, gym_, cfg, opts['split'], opts['n'], opts['greedy'])
    for t in trajs:
        print_episode(t, gym_['tok'])
    n, n_bad = len(trajs), sum(not t.valid for t in trajs)
    print(f"{n} episodes: mean reward {sum(t.reward for t in trajs) / n:.3f}, "
          f"success {sum(bool(t.info.get('success')) for t in trajs) / n:.3f}" + (f", invalid {n_bad}" if n_bad else ''))
    if opts['html']:
        print('wrote', write_html(opts['html'], trajs, gym_['tok'], advantages, 'nanoagent · ' + title))


if __name__ == '__main__':
    if hasattr(signal, 'SIGPIPE'):  # `python sample.py ... | head` ends quietly, as other command-line tools
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main(sys.argv[1:])
