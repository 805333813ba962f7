"""
Where do a memory-gym agent's multi-part answers go wrong? For each checkpoint given, every held-out
and validation task once, greedy (sample.evaluate: train.py's evaluation), and per objective of each
task: was it opened, did the turn that opened it write the right relation chain into <mem> (its plan:
the segment 'root root rel1 rel2 ...' the oracle writes, gyms/memory.py), and is its part of the
final answer right; a wrong plan is counted as shorter or longer than the right one when it has
fewer or more words. Prints one line per split, number of parts k and objective j (1 = first).

    python scripts/memory_plans.py out/val_Q_s40/ckpt_000000.pt out/val_Q_s40/ckpt_000060.pt

A plan is read from the first segment of any turn's <mem> that starts with the objective's root
written twice; a policy that writes its memory another way opens nothing by this count.
"""
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyms import memory as gm
from gyms.answers import em, extract_answer, extract_mem

COLUMNS = ('opened', 'plan_right', 'plan_shorter', 'plan_longer', 'answered', 'right', 'right_after_right_plan')


def part_outcomes(task, actions):
    """Per objective of a memory task, in the question's order: dict of bools (COLUMNS; plan_shorter and
    plan_longer: a wrong plan with fewer or more words than the right one, i.e. hops dropped or added),
    from the episode's decoded policy turns `actions` (list[str])."""
    segments = [s.split() for a in actions for s in (extract_mem('<mem> ' + a) or '').split(';')]
    answer = extract_answer(actions[-1]) if actions else None
    parts = [p.strip() for p in answer.split(';')] if answer is not None else []
    out = []
    for j, question in enumerate(task.question.split(' ; ')):
        plan = gm._pending_chain(question).split()
        seg = next((s for s in segments if s[:2] == plan[:2]), None)
        got = parts[j] if j < len(parts) else ''
        right = bool(got) and em(got, task.golds[j]) == 1.0
        wrong = seg is not None and seg != plan
        out.append(dict(opened=seg is not None, plan_right=seg == plan, plan_shorter=wrong and len(seg) < len(plan),
                        plan_longer=wrong and len(seg) > len(plan), answered=bool(got), right=right,
                        right_after_right_plan=right and seg == plan))
    return out


def tally(trajs, split):
    """{(split, k, j): Counter of COLUMNS and 'n'} over trajectories (their task and info['actions'])."""
    rows = {}
    for t in trajs:
        outcomes = part_outcomes(t.task, t.info['actions'])
        for j, o in enumerate(outcomes, 1):
            c = rows.setdefault((split, len(outcomes), j), Counter())
            c['n'] += 1
            c.update({k: int(v) for k, v in o.items()})
    return rows


if __name__ == '__main__':
    import sample
    if len(sys.argv) < 2 or any(a.startswith('--') for a in sys.argv[1:]):
        sys.exit(__doc__.strip().split('\n\n')[1])
    for path in sys.argv[1:]:
        cfg, gym_, model, _, _ = sample.load_run([], ckpt=path)
        if cfg['gym'] != 'memory':
            sys.exit(f"memory_plans.py: {path} is a {cfg['gym']} run; plans are the memory gym's")
        for split in ('heldout', 'val'):
            if not gym_.get(sample.SPLITS[split]):  # no validation tasks (val_tasks: 0)
                continue
            _, trajs = sample.evaluate(model, gym_, cfg, samples=1, greedy=True, split=split)
            for (s, k, j), c in sorted(tally(trajs, split).items()):
                print(f"{path} {s} k={k} part {j}: {c['n']} tasks, " + ', '.join(f'{name} {c[name]}' for name in COLUMNS))
