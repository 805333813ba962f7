"""
MemPO ablation on the memory gym: three agents, several seeds, one table. With --main, a seed sweep
of the main job instead.

    python ablate.py --jobs=2             # full: 3 variants x 3 seeds of config/tiny_mem.yaml (about 55 min on 2 CPU cores)
    python ablate.py --quick              # 1 seed, short runs in out/ablate_quick: checks the pipeline end to end (minutes)
    python ablate.py --seeds=1,2 --steps=40 --out=out/ablate2   # any --key=value goes to every train.py run
    python ablate.py --main --seeds=1,2,3 --jobs=2              # the main job (config/tiny.yaml) once per seed

Variants (everything else from the config file):
  mempo      folding (keep_tool_results=1) + memory advantage (mem_coef from the config, > 0)
  grpo_fold  folding, outcome advantage only (mem_coef=0)
  grpo_full  full history (keep_tool_results=all), outcome advantage only
Each run is `python train.py CONFIG --key=value ...` in its own process and out_dir (--jobs=2 runs
two at a time: each uses one thread, so two fill two cores; a line is printed as each run starts and
ends, its own progress bar goes to stderr). Its last evaluation line in
metrics.jsonl is the result: held-out EM, F1, memory quality (the fraction of what later turns need
that a <mem> holds, gyms/memory.py), tokens processed per episode (TT) and mean peak context (PT),
per number of objectives k; with its minutes in RL steps and its EM at every evaluation (the learning
curve). The table (mean +- standard error over seeds) is printed in markdown and written with the
per-run numbers to OUT/ablation.json. The lossy set-up, where memory has to be learned by RL:
`python ablate.py --seeds=1,2,3,4,5 --jobs=2 --oracle_forget=0.5 --out=out/ablate_lossy`. A run whose config.json matches and whose metrics already hold the final step is
not run again (--rerun forces it). A finished run with other options in a run's out_dir stops ablate
before any run, naming the options (--rerun replaces it, or choose another --out); an unfinished one
(stopped, or failed) runs again from scratch. --quick writes to OUT_quick unless --out is given.

Flags of this script: --main --quick --seeds=1,2,3 --out=DIR --config=FILE --ks=1,2,4,5 --jobs=1 --rerun --dry_run
--variants=mempo,grpo_fold,grpo_full (any of VARIANTS, e.g. mempo_turn, mempo_found) --val (the table from the
validation split, eval_val_*: choose there, report held-out).
k = 5 is one objective more than training draws (the memory gym trains on 1-4).

--main: one variant, `main` (the config file as it is; --config defaults to config/tiny.yaml, --out
to out/seeds, --ks is not used), run once per seed in the same way, --key=value passed through. Its
table is mean +- standard error over seeds (sample std / sqrt(seeds); a single seed shows the mean
alone) of: validation success and held-out sampled success at the last step, greedy held-out success,
train success over the last 10 RL steps, and wall time (minutes, as ablate timed the run; `-` for a
run it did not start). Then what RL changed over the warm start: each evaluation number at step 0
and at the last step, and their difference paired by seed (mean +- standard error, and per seed), for
the numbers every run logs (EM per k, truncation and turn format on the answer gyms).
Recipes are compared on validation, never on held-out.

Simplifications, on purpose:
1. Runs are subprocesses, --jobs of them at a time (default 1): no scheduler, no resource checks.
2. Seeds change the training draw, the initialisation and the held-out worlds together.
"""

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from report import read_metrics, read_run_config
from config import config as config_defaults, fail, load_config, parse_options
from gym import gym_module

VARIANTS = {  # name -> overrides on top of the config file; --variants picks some (default: the first three)
    'mempo': [],
    'grpo_fold': ['--mem_coef=0'],
    'grpo_full': ['--keep_tool_results=all', '--mem_coef=0'],
    'mempo_turn': ['--mem_pool=turn'],  # the memory-credit options (docs/GUIDE.md, MemPO in full)
    'mempo_nostd': ['--mem_std=false'],
    'mempo_success': ['--mem_success_only=true'],
    'mempo_found': ['--mem_target=found'],
    'mempo_turn_found': ['--mem_pool=turn', '--mem_target=found'],
    'pmem_turn_found': ['--mem_baseline=none', '--mem_pool=turn', '--mem_target=found'],  # P_mem alone, no P_full
    'pmem_turn_found_025': ['--mem_baseline=none', '--mem_pool=turn', '--mem_target=found', '--mem_coef=0.25'],  # weighted as ReMemR1 mixes
}
MAIN_VARIANTS = {'main': []}  # --main: the config file as it is, one run per seed
QUICK = ['--steps=4', '--eval_every=0', '--warmstart_steps=200', '--warmstart_episodes=512', '--eval_tasks=32', '--eval_samples=1']
METRICS = ('em', 'f1', 'mem_quality', 'tt', 'pt')
DIAGNOSIS = ('mem_reward_quality_corr', 'mem_adv_abs_mean', 'outcome_adv_abs_mean')  # per RL step, MemPO runs
MAIN_COLUMNS = {  # --main: table column -> a run's number (run_numbers)
    'validation': 'eval_val_success', 'held-out': 'eval_success_rate', 'held-out greedy': 'eval_greedy_success',
    'train (last 10 steps)': 'train_success_last10', 'wall (min)': 'wall_min'}
GAINS = {  # --main: what RL changed, last evaluation minus step 0's in the same run (lines for keys every run has)
    'held-out': 'eval_success_rate', 'held-out EM': 'eval_em', **{f'held-out EM k={k}': f'eval_em_k{k}' for k in range(1, 6)},
    'held-out greedy': 'eval_greedy_success', 'validation': 'eval_val_success', 'validation EM': 'eval_val_em',
    'held-out truncated': 'eval_truncation_rate', 'held-out turn format': 'eval_turn_format_ok'}
WALL = 'ablate_wall.json'  # in a run's out_dir: its wall time as ablate measured it

# -----------------------------------------------------------------------------


def parse_args(argv):
    """Split argv into this script's options (dict) and the --key=value list passed to train.py."""
    opts = dict(main=False, quick=False, seeds='1,2,3', out='out/ablate', config='config/tiny_mem.yaml', ks='1,2,4,5',
                rerun=False, dry_run=False, jobs='1', variants='mempo,grpo_fold,grpo_full', val=False)
    opts, passthrough = parse_options(argv, opts)
    opts['variants'] = opts['variants'].split(',')
    if not set(opts['variants']) <= set(VARIANTS):
        fail(f"--variants={','.join(opts['variants'])}: choose from {', '.join(VARIANTS)}")
    given = lambda key: any(a.startswith(f'--{key}=') for a in argv)
    if opts['quick'] and not given('seeds'):
        opts['seeds'] = '1'
    if opts['main']:
        opts['config'] = opts['config'] if given('config') else 'config/tiny.yaml'
        opts['out'] = opts['out'] if given('out') else 'out/seeds'
    if opts['quick'] and not given('out'):  # short runs never land in (and replace) the full runs' folders
        opts['out'] += '_quick'
    for key in ('seeds', 'ks', 'jobs'):
        try:
            opts[key] = [int(x) for x in str(opts[key]).split(',')]
        except ValueError:
            fail(f"--{key} takes {'one integer' if key == 'jobs' else 'integers separated by commas'}, got {opts[key]!r}")
    if len(set(opts['seeds'])) != len(opts['seeds']):
        fail(f"--seeds repeats a seed: {','.join(map(str, opts['seeds']))} (one run, one out_dir per seed)")
    if min(opts['ks']) < 1:
        fail(f"--ks takes numbers of objectives >= 1, got {','.join(map(str, opts['ks']))}")
    if len(opts['jobs']) != 1 or opts['jobs'][0] < 1:
        fail(f"--jobs takes one integer >= 1, got {','.join(map(str, opts['jobs']))}")
    opts['jobs'] = opts['jobs'][0]
    owned = {'seed': 'use --seeds', 'out_dir': 'use --out', 'overwrite': 'always on; --rerun reruns finished runs',
             'resume': 'finished runs are skipped, others rerun'}
    if not opts['main']:
        owned.update(mem_coef="the variants set it; MemPO's value comes from --config's file",
                     keep_tool_results='the variants set it')
    for a in passthrough:  # a passed-through key that ablate sets itself would silently undo a variant or a seed
        if not a.startswith('--'):  # a YAML file could set any of them unseen
            fail(f"{a}: ablate.py takes one config file, as --config={a}; other arguments are --key=value")
        key = a[2:].split('=', 1)[0]
        if key in owned:
            fail(f"--{key} cannot be passed through: ablate.py sets it for each run ({owned[key]})")
    return opts, passthrough


def run_dir(out, variant, seed):
    return os.path.join(out, f'{variant}_s{seed}')


def eval_lines(metrics):
    """The metrics lines that carry evaluation numbers (eval_*), in the order logged."""
    return [r for r in metrics if any(k.startswith('eval_') for k in r)]


def final_eval(metrics_path):
    """The last metrics line that carries evaluation numbers (eval_*), or None."""
    rows = eval_lines(read_metrics(metrics_path)) if os.path.exists(metrics_path) else []
    return rows[-1] if rows else None


def run_numbers(out_dir):
    """A finished run's numbers: its last evaluation line (final_eval), train_success_last10 (mean
    train success of its last 10 RL steps), step0 (its step-0 evaluation numbers, the warm start's;
    {} when it has none), rl_min (minutes in RL steps: rollout, scoring, update; evaluations
    excluded), curve ({step: held-out EM} at every evaluation), wall_min (when ablate ran it, see
    WALL), out_dir."""
    metrics = read_metrics(os.path.join(out_dir, 'metrics.jsonl'))
    rows = [r for r in metrics if r['step'] > 0 and 'success_rate' in r]
    evals = eval_lines(metrics)  # a finished run has at least one
    first = evals[0]
    out = dict(evals[-1], out_dir=out_dir)
    out['step0'] = {k: v for k, v in first.items() if k.startswith('eval_')} if first['step'] == 0 else {}
    out['curve'] = {str(r['step']): r['eval_em'] for r in metrics if 'eval_em' in r}
    if rows:
        out['train_success_last10'] = mean_std([r['success_rate'] for r in rows[-10:]])[0]
        out['rl_min'] = sum(r.get('step_time_s', 0.0) for r in rows) / 60  # RL steps only, evaluations excluded
    for key in DIAGNOSIS:  # MemPO's runs: the mean over RL steps of what each step logged
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key] = sum(vals) / len(vals)
    if rows and all('mem_reward_time_s' in r for r in rows):
        out['mem_reward_share'] = sum(r['mem_reward_time_s'] for r in rows) / sum(r['step_time_s'] for r in rows)
    if os.path.exists(os.path.join(out_dir, WALL)):
        out['wall_min'] = json.load(open(os.path.join(out_dir, WALL)))['wall_s'] / 60
    return out


def run_config(config, variant, seed, out_dir, extra):
    """(train.py command, the config dict it will run with) for one run. A bad key or value in
    extra, or a missing config file, stops here with train.py's one-line error, before any run."""
    # --overwrite: ablate decided to (re)run this out_dir, so an earlier run's checkpoints there go
    args = [config, *{**VARIANTS, **MAIN_VARIANTS}[variant], f'--seed={seed}', f'--out_dir={out_dir}', '--overwrite=True', *extra]
    cfg = load_config(args)
    gym_module(cfg, config_defaults)  # a gym-specific key this gym ignores stops here too, before any run
    if variant == 'mempo' and not cfg['mem_coef']:  # three variants that differ in nothing the table could show
        fail(f"{config}: mem_coef is 0, so the mempo variant would be grpo_fold; the ablation needs a config with "
             f"mem_coef > 0 (a gym whose turns write <mem>, e.g. config/tiny_mem.yaml)")
    return [sys.executable, 'train.py', *args], cfg


def finished_differences(out_dir, cfg):
    """None when out_dir holds no finished run (no config.json, or no evaluation at its own final
    step); else {key: (saved value, cfg's value)} for the options it ran with that differ from cfg
    ({}: the run cfg asks for, finished)."""
    last = final_eval(os.path.join(out_dir, 'metrics.jsonl'))
    try:
        saved = read_run_config(out_dir)
    except ValueError:
        return None
    if last is None or saved is None or last['step'] != saved.get('steps'):
        return None
    # out_dir is where the run lies, not how it ran: '/abs/out/x' and 'out/x' are one finished run
    # dtype: auto is saved as what it chose (bfloat16 or float32, by the machine): either is that run
    return {k: (saved.get(k), v) for k, v in cfg.items() if k not in ('device', 'resume', 'overwrite', 'out_dir')
            and saved.get(k) != v and not (k == 'dtype' and v == 'auto' and saved.get(k) in ('bfloat16', 'float32'))}


def mean_std(xs):
    """(mean, population std) of a non-empty list of floats; (nan, nan) when empty."""
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def mean_se(xs):
    """(mean, standard error of the mean: sample std / sqrt(n)) of a list of floats; the error is nan
    for one value (fmt shows the mean alone), both are nan for none."""
    m, s = mean_std(xs)
    return m, s / math.sqrt(len(xs) - 1) if len(xs) > 1 else math.nan


def k_columns(ks, prefix='eval_'):
    """The MemPO table's numbers: {f'{metric}_k{k}': f'{prefix}{metric}_k{k}'} for every k and METRICS
    (prefix 'eval_val_': the validation split's), and the RL phase's minutes (rl_min)."""
    return dict({f'{m}_k{k}': f'{prefix}{m}_k{k}' for k in ks for m in METRICS}, rl_min='rl_min',
                mem_reward_share='mem_reward_share', **{k: k for k in DIAGNOSIS})


def curves(results, stat=mean_se):
    """{variant: {step: stat(held-out EM over seeds at that evaluation step)}}: the learning curve."""
    out = {}
    for variant, runs in results.items():
        steps = sorted({int(s) for r in runs for s in r.get('curve', {})})
        out[variant] = {st: stat([r['curve'][str(st)] for r in runs if str(st) in r.get('curve', {})]) for st in steps}
    return out


def aggregate(results, columns, stat=mean_std):
    """results: {variant: [run_numbers dict per seed]}, columns: {name: key of a run's numbers} ->
    {variant: {name: stat(the values over seeds), 'steps', 'seeds'}}. A run without the key (a k
    absent from its held-out draw, a wall time ablate did not measure) is skipped for that name."""
    out = {}
    for variant, runs in results.items():
        agg = dict(seeds=len(runs), steps=max((r['step'] for r in runs), default=0))
        for name, key in columns.items():
            agg[name] = stat([r[key] for r in runs if key in r])
        out[variant] = agg
    return out


def fmt(ms, digits):
    m, s = ms
    if m != m:
        return '-'
    return f'{m:.{digits}f}' if s == 0 or s != s else f'{m:.{digits}f} ± {s:.{digits}f}'


def markdown_table(agg, ks, curve=None):
    """One row per (variant, k): EM, F1 and memory quality in [0, 1], TT and PT in tokens, mean ±
    standard error over seeds; then the RL phase's minutes per variant (and MemPO's against
    grpo_fold's), held-out EM against RL steps (curve: curves()), and MemPO against full history."""
    lines = ['| variant | k | EM | F1 | memory quality | TT (tokens) | PT (tokens) | steps | seeds |',
             '|---|---|---|---|---|---|---|---|---|']
    for variant, a in agg.items():
        for k in ks:
            lines.append(f"| {variant} | {k} | {fmt(a[f'em_k{k}'], 3)} | {fmt(a[f'f1_k{k}'], 3)} | "
                         f"{fmt(a[f'mem_quality_k{k}'], 3)} | {fmt(a[f'tt_k{k}'], 0)} | {fmt(a[f'pt_k{k}'], 0)} | "
                         f"{a['steps']} | {a['seeds']} |")
    lines += ['', 'RL phase (minutes in RL steps, evaluations excluded): ' +
              '; '.join(f"{v} {fmt(a['rl_min'], 1)}" for v, a in agg.items())]
    if 'mempo' in agg and 'grpo_fold' in agg and agg['grpo_fold']['rl_min'][0] > 0:
        lines.append(f"MemPO / grpo_fold RL time = {agg['mempo']['rl_min'][0] / agg['grpo_fold']['rl_min'][0]:.2f}x")
    for variant, a in agg.items():  # does the memory reward track memory quality, and how loud is it?
        if a['mem_adv_abs_mean'][0] == a['mem_adv_abs_mean'][0]:
            lines.append(f"{variant} per RL step (mean over steps; ± over seeds): memory reward vs memory quality "
                         f"correlation {fmt(a['mem_reward_quality_corr'], 3)}; |memory advantage| on <mem> tokens "
                         f"{fmt(a['mem_adv_abs_mean'], 2)} against |outcome advantage| {fmt(a['outcome_adv_abs_mean'], 2)}; "
                         f"memory rewards' share of the step time {fmt(a['mem_reward_share'], 2)}")
    for variant, points in (curve or {}).items():
        lines.append(f'held-out EM by RL step, {variant}: ' + ', '.join(f'{st}: {fmt(ms, 3)}' for st, ms in points.items()))
    if 'mempo' in agg and 'grpo_full' in agg:
        lines.append('')
        for k in ks:  # the comparison the MemPO paper makes: context saved, accuracy kept?
            mem, full = agg['mempo'], agg['grpo_full']
            if full[f'pt_k{k}'][0] > 0 and mem[f'em_k{k}'][0] == mem[f'em_k{k}'][0]:
                lines.append(f"k={k}: MemPO peak context / full history = {mem[f'pt_k{k}'][0] / full[f'pt_k{k}'][0]:.2f}; "
                             f"EM difference (MemPO - full) = {mem[f'em_k{k}'][0] - full[f'em_k{k}'][0]:+.3f}")
    return '\n'.join(lines)


def paired_lines(results, ks, b='grpo_fold', prefix='eval_'):
    """EM of each memory-credit variant (every one not named grpo_*) minus variant b per k, seed by seed
    (they share each seed's warm start and worlds), as mean ± standard error over the seeds both
    finished: the comparison the lossy set-up asks for. prefix 'eval_val_': on the validation split.
    [] when b is missing."""
    out = []
    for a in [v for v in results if not v.startswith('grpo')] if b in results else []:
        for k in ks:
            key = f'{prefix}em_k{k}'
            diffs = [ra[key] - rb[key] for ra, rb in zip(results[a], results[b]) if key in ra and key in rb]
            if diffs:
                m, se = mean_se(diffs)
                out.append(f"k={k}: {a} - {b} EM, paired by seed: {fmt((m, se), 3)}"
                           + (f" ({m / se:+.1f} standard errors)" if se == se and se > 0 else ''))
    return out


def main_table(agg, config):
    """--main: one row, mean ± standard error over seeds of MAIN_COLUMNS (success in [0, 1], wall time in minutes)."""
    a = agg['main']
    cols = [fmt(a[name], 1 if name == 'wall (min)' else 3) for name in MAIN_COLUMNS]
    return '\n'.join([f"| config | {' | '.join(MAIN_COLUMNS)} | steps | seeds |",
                      '|---' * (len(MAIN_COLUMNS) + 3) + '|',
                      f"| {config} | {' | '.join(cols)} | {a['steps']} | {a['seeds']} |",
                      '', f"mean ± standard error over {a['seeds']} seed(s); validation and held-out at the last step"])


def gain_lines(runs, seeds):
    """--main: for each GAINS number every run has at step 0 and at its last evaluation, its mean over
    seeds before and after RL and the paired gain (last minus step 0, same run and worlds) as mean ±
    standard error, with the gain of each seed. runs: run_numbers dicts in the order of seeds."""
    lines = []
    for name, key in GAINS.items():
        if not runs or not all(key in r and key in r['step0'] for r in runs):
            continue
        gains = [r[key] - r['step0'][key] for r in runs]
        m, se = mean_se(gains)
        lines.append(f"{name}: {fmt(mean_se([r['step0'][key] for r in runs]), 3)} -> {fmt(mean_se([r[key] for r in runs]), 3)}, "
                     f"gain {m:+.3f}" + (f" ± {se:.3f} ({m / se:+.1f} standard errors)" if se == se and se > 0 else '')
                     + '; by seed ' + ', '.join(f'{s} {g:+.3f}' for s, g in zip(seeds, gains)))
    return lines


def run_job(job):
    """Run one (variant, seed, cmd, out_dir) train.py process; print a line when it starts and ends, and
    write its wall time to out_dir/WALL when it succeeds. Returns its exit code."""
    variant, seed, cmd, out_dir = job
    if os.path.exists(os.path.join(out_dir, WALL)):
        os.remove(os.path.join(out_dir, WALL))  # an earlier run's time is not this run's
    t0 = time.time()
    print(f'started  {variant} seed {seed}', flush=True)
    code = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    wall = time.time() - t0
    print(f"{'finished' if code == 0 else 'FAILED  '} {variant} seed {seed} in {wall / 60:.1f} min", flush=True)
    if code == 0:
        with open(os.path.join(out_dir, WALL), 'w') as f:
            json.dump(dict(wall_s=wall), f)
    return code


def main(argv):
    if '--help' in argv or '-h' in argv:
        print(__doc__.strip())
        return None
    opts, passthrough = parse_args(argv)
    extra = (QUICK if opts['quick'] else []) + passthrough
    variants = MAIN_VARIANTS if opts['main'] else {v: VARIANTS[v] for v in opts['variants']}
    runs = [(variant, seed) for seed in opts['seeds'] for variant in variants]  # seed by seed: a stopped ablation leaves whole seeds
    todo = []
    for variant, seed in runs:
        d = run_dir(opts['out'], variant, seed)
        cmd, cfg = run_config(opts['config'], variant, seed, d, extra)
        print('python ' + ' '.join(cmd[1:]), flush=True)
        differences = finished_differences(d, cfg)
        if differences and not opts['rerun']:  # every run goes with --overwrite: never over a finished run unasked
            fail(f"{d} holds a finished run with other options ("
                 + ', '.join(f'{k}: {old!r} there, {new!r} here' for k, (old, new) in sorted(differences.items()))
                 + "): --rerun replaces it, or choose another --out")
        if not opts['dry_run'] and (opts['rerun'] or differences != {}):
            todo.append((variant, seed, cmd, d))
    if opts['dry_run']:
        return None
    # --jobs=N runs N train.py processes at once (each keeps its own `threads` setting), seed by seed and
    # within a seed in VARIANTS order: the MemPO run, the longest (it scores the memory rewards), first
    with ThreadPoolExecutor(max_workers=opts['jobs']) as pool:
        codes = list(pool.map(run_job, todo))
    for (variant, seed, _, _), code in zip(todo, codes):
        if code:  # its progress bar and its own error stay on stderr
            print(f'error: the {variant} run (seed {seed}) failed; its own error is above', file=sys.stderr)
            sys.exit(2)
    results = {variant: [] for variant in variants}
    for variant, seed in runs:
        results[variant].append(run_numbers(run_dir(opts['out'], variant, seed)))
    if opts['main']:
        agg = aggregate(results, MAIN_COLUMNS, mean_se)
        table = '\n'.join([main_table(agg, opts['config']), '', 'RL over the warm start (step 0 -> last evaluation, '
                           'mean ± standard error over seeds; gain paired by seed):'] + gain_lines(results['main'], opts['seeds']))
    else:
        prefix = 'eval_val_' if opts['val'] else 'eval_'
        agg = aggregate(results, k_columns(opts['ks'], prefix), mean_se)
        table = '\n'.join([markdown_table(agg, opts['ks'], curves(results)), ''] + paired_lines(results, opts['ks'], prefix=prefix))
    print(table)
    os.makedirs(opts['out'], exist_ok=True)
    path = os.path.join(opts['out'], 'ablation.json')
    with open(path, 'w') as f:
        json.dump(dict(config=opts['config'], seeds=opts['seeds'], extra_args=extra, table=table,
                       aggregate={v: {k: list(x) if isinstance(x, tuple) else x for k, x in a.items()} for v, a in agg.items()},
                       runs=results), f, indent=1)
    print(f'wrote {path}')
    return agg


if __name__ == '__main__':
    main(sys.argv[1:])
