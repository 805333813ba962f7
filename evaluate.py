"""
Evaluate a policy on held-out tasks and print its numbers: success, reward, EM / F1 (SearchQA and the
memory gym), turns per episode, tokens processed per episode (TT: every turn's context + response)
and peak context (PT), truncation and format rates.

    python evaluate.py config/smollm2_hotpotqa.yaml --eval_tasks=50                 # zero-shot SmolLM2, folded
    python evaluate.py config/smollm2_hotpotqa.yaml --eval_tasks=50 --keep_tool_results=all
    python evaluate.py --out_dir=out/qwen3_hotpotqa                               # the newest checkpoint there
    python evaluate.py config/qwen3_quixbugs.yaml --sampled --samples=4 --json=eval.json

Flags of this script: --untrained (ignore checkpoints), --sampled (sample at the config's temperature;
default greedy), --samples=1 (episodes per task), --batch=16 (episodes per rollout batch: memory),
--show=2 (episodes printed in full), --json=FILE, --html=FILE. Every other argument is train.py's
config (eval_tasks = how many held-out tasks, 0 = all), on top of the checkpoint's own config when
out_dir holds one, as in sample.py. The numbers come from the same functions as train.py's eval_* metrics.

Simplification, on purpose: one rollout batch at a time, no sharding over processes.
"""

import json
import sys
import time
from collections import Counter

import torch
from tqdm import tqdm

import sample
import train

OPTIONS = dict(untrained=False, sampled=False, samples=1, batch=16, show=2, json='', html='')


def evaluate(model, gym_, cfg, samples=1, greedy=True, batch=16):
    """Run every held-out task of gym_ `samples` times, `batch` episodes per rollout batch.
    Returns (metrics dict, trajectories). Sampling (greedy=False) draws from a generator seeded by
    cfg['seed'], so the same arguments give the same numbers on CPU."""
    tasks = gym_['eval_tasks']
    gen = torch.Generator(device=cfg['device']).manual_seed(cfg['seed'])
    per = max(1, batch // samples)  # tasks per rollout batch; a task's samples stay together
    trajs = []
    for i in tqdm(range(0, len(tasks), per), desc='eval', unit='batch', leave=False):
        trajs += train.rollout_step(model, gym_, dict(cfg, group_size=samples), tasks[i:i + per], gen,
                                    temperature=0.0 if greedy else None)
    return episode_numbers(trajs), trajs


def episode_numbers(trajs):
    """train.py's episode metrics (reward, success, truncation, TT, PT, EM / F1 overall and per
    objective count) plus turns, invalid turns, format rate and stop reasons."""
    eps = [train.summarise(t) for t in trajs]
    n = max(len(trajs), 1)
    out = dict(episodes=len(trajs), **train.episode_metrics(eps),
               turns_mean=sum(len(t.turns) for t in trajs) / n,
               invalid_turns_mean=sum(t.info.get('n_invalid', 0) for t in trajs) / n,
               stops=dict(Counter(str(t.info.get('stop')) for t in trajs)))
    if any('format_ok' in t.info for t in trajs):  # SearchQA: the whole episode passed validate_format
        out['format_ok_rate'] = sum(bool(t.info.get('format_ok')) for t in trajs) / n
    return out


def main(argv):
    opts, rest = sample.parse_args(argv, OPTIONS)
    if opts['samples'] < 1 or opts['batch'] < 1:
        train.fail('--samples and --batch must be at least 1')
    t0 = time.time()
    cfg, gym_, model, policy = sample.load_run(rest, opts['untrained'])
    numbers, trajs = evaluate(model, gym_, cfg, opts['samples'], not opts['sampled'], opts['batch'])
    for t in trajs[:opts['show']]:
        sample.print_episode(t, gym_['tok'])
    settings = {k: cfg[k] for k in ('gym', 'model', 'data', 'prompt_style', 'keep_tool_results', 'max_turns',
                                    'max_response_tokens', 'max_obs_tokens', 'max_len', 'enable_thinking')}
    result = dict(policy=policy, **settings, decoding='sampled' if opts['sampled'] else 'greedy',
                  temperature=cfg['temperature'] if opts['sampled'] else 0.0, tasks=len(gym_['eval_tasks']),
                  samples=opts['samples'], **numbers, wall_s=round(time.time() - t0, 1))
    keys = ['em', 'f1', 'success_rate', 'reward_mean', 'turns_mean', 'tt', 'pt', 'truncation_rate', 'format_ok_rate']
    print(f"{policy} on {result['tasks']} held-out {cfg['gym']} tasks x {opts['samples']}, {result['decoding']}, "
          f"keep_tool_results={cfg['keep_tool_results']}: "
          + ', '.join(f'{k} {result[k]:.3f}' if isinstance(result[k], float) else f'{k} {result[k]}'
                      for k in keys if k in result))
    print(json.dumps(result))
    if opts['json']:
        with open(opts['json'], 'w') as f:
            json.dump(result, f, indent=1)
    if opts['html']:
        print('wrote', sample.write_html(opts['html'], trajs, gym_['tok'], title=f"nanoagent · eval · {policy}"))
    return result


if __name__ == '__main__':
    main(sys.argv[1:])
