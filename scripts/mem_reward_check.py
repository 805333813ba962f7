"""
Does MemPO's memory reward track memory quality? For the newest checkpoint of each run directory given
(a memory-gym run), sample one episode on each of 64 training tasks, score every turn's P_mem and
P_full exactly as training does (advantage.memory_rewards) and print their means and their correlation
with the turn's memory quality (gyms/memory.py, memory_quality: the fraction of what later turns need
that the <mem> holds). Then the same means on the oracle's episodes of 64 training tasks with 3 or
more objectives, once with complete memories and once with lossy ones (every finished answer but the
last forgotten): does the reward tell them apart? The lossy set-up's diagnosis, on training tasks only.

    python scripts/mem_reward_check.py out/ablate_lossy/mempo_s1 out/ablate_lossy/grpo_fold_s1
    python scripts/mem_reward_check.py out/tiny_mem --mem_target=found   # --key=value: score as that option would
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import advantage
import report
import rollout
from config import config, fail, load_config, resolve_dtype
from gym import load_gym
from gyms import memory as gm
from model import load_policy


def pearson(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-12))


def probe(model, gym_, cfg, trajs):
    """{turns, lossy, P_mem, P_full, reward_std, corr_mem, corr_full, corr_reward} of memory-gym
    trajectories: over the turns that memory_rewards scores and whose quality is defined, the mean P's,
    the standard deviation of the reward P_mem - P_full, and the Pearson correlations of P_mem, P_full
    and the reward with the quality; lossy counts turns of quality < 1. turns is 0 (and nothing else
    is given) when no such turn exists."""
    answers = [gym_['answer_text'](t.task) for t in trajs]
    where, p_full, p_mem = advantage.memory_probs(model, trajs, gym_['fmt'], answers, cfg)  # as training scores them
    rows = []
    for (n, k), pf, pm in zip(where, p_full.tolist(), p_mem.tolist()):
        q = trajs[n].info.get('mem_quality_turns', [])
        if k < len(q) and q[k] is not None:
            rows.append((pm, pf, q[k]))
    if not rows:  # an untrained policy finds no fact, so no memory has a defined quality
        return dict(turns=0)
    pm, pf, q = zip(*rows)
    r = torch.tensor([a - b for a, b in zip(pm, pf)], dtype=torch.float64)
    return dict(turns=len(rows), lossy=sum(x < 1 for x in q), P_mem=sum(pm) / len(pm), P_full=sum(pf) / len(pf),
                reward_std=float(r.std()) if len(rows) > 1 else 0.0,
                corr_mem=pearson(pm, q), corr_full=pearson(pf, q), corr_reward=pearson(r.tolist(), q))


def check(out_dir, overrides=(), n_tasks=64):
    """probe() of one sampled episode on each of n_tasks training tasks (seeded) by the newest checkpoint
    in out_dir, with its step; overrides (--key=value) change the run's config (e.g. the memory reward's
    options). Exits 2 with one line without a checkpoint or for another gym's run."""
    state, path = report.load_latest_checkpoint(out_dir, 'name another run')
    if state is None:
        fail(f'no checkpoint in {out_dir}')
    cfg = load_config(list(overrides), dict(config, **state['config']))
    if cfg['gym'] != 'memory':
        fail(f"{out_dir} is a {cfg['gym']!r} run; memory quality is defined by the memory gym")
    cfg['device'] = 'cpu'
    resolve_dtype(cfg, master=False)  # an override --dtype=auto computes as train.py would
    gym_ = load_gym(cfg, state.get('vocab'), config)
    model = load_policy(cfg, gym_['tok'].vocab_size)
    model.load_state_dict(state['model'])
    model.eval()
    rng = random.Random(0)
    tasks = [rng.choice(gym_['train_tasks']) for _ in range(n_tasks)]
    trajs = rollout.run_tasks(model, gym_, cfg, tasks, 1, generator=torch.Generator().manual_seed(0))
    out = dict(step=state['step'], **probe(model, gym_, cfg, trajs))
    # the same rewards on scripted episodes of 3+ objectives whose memories are complete or lose every
    # finished answer but the last: the same searches, only the <mem> differs
    tasks = [t for t in gym_['train_tasks'] if len(t.golds) >= 3][:n_tasks]
    for name, forget in (('complete', False), ('lossy', True)):
        policy = gm.folded_policy(lambda q, m, o, f=forget: gm.oracle_policy(q, m, o, forget=f))
        trajs = rollout.rollout_batch([policy] * len(tasks), gym_['fmt'], [gym_['make_env']() for _ in tasks], tasks, cfg)
        out[f'oracle_{name}'] = probe(model, gym_, cfg, trajs)
    return out


if __name__ == '__main__':
    if not sys.argv[1:] or sys.argv[1] in ('-h', '--help'):
        print(__doc__.strip())
        sys.exit(0 if sys.argv[1:] else 2)
    torch.set_num_threads(1)
    overrides = [a for a in sys.argv[1:] if a.startswith('--')]
    for out_dir in [a for a in sys.argv[1:] if not a.startswith('--')]:
        r = check(out_dir, overrides)
        if r['turns']:
            print(f"{out_dir} (step {r['step']}): sampled, {r['turns']} turns, {r['lossy']} with quality < 1; mean "
                  f"P_mem {r['P_mem']:.3f}, P_full {r['P_full']:.3f}, reward std {r['reward_std']:.3f}; correlation with quality: P_mem "
                  f"{r['corr_mem']:+.2f}, P_full {r['corr_full']:+.2f}, P_mem - P_full {r['corr_reward']:+.2f}")
        else:
            print(f"{out_dir} (step {r['step']}): sampled, no scored turn has a defined memory quality (no fact found yet)")
        for name in ('complete', 'lossy'):
            o = r[f'oracle_{name}']
            print(f"  oracle, {name} memories: {o['turns']} turns, mean P_mem {o['P_mem']:.3f}, P_full {o['P_full']:.3f}, "
                  f"P_mem - P_full {o['P_mem'] - o['P_full']:+.3f}" if o['turns'] else f"  oracle, {name} memories: no scored turn")
        c, lo = r['oracle_complete'], r['oracle_lossy']
        if c['turns'] and lo['turns'] and r['turns']:  # the test: a gap larger than the reward's spread
            gap = (c['P_mem'] - c['P_full']) - (lo['P_mem'] - lo['P_full'])
            print(f"  complete - lossy: {gap:+.3f}, {gap / max(r['reward_std'], 1e-12):+.2f} x the reward's std over sampled turns")
