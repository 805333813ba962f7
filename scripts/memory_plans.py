"""
Where do a memory-gym agent's multi-part answers go wrong? For each checkpoint given, every held-out
and validation task once, greedy (sample.evaluate: train.py's evaluation), and per objective of each
task: was it opened, did the turn that opened it write the right relation chain into <mem> (its plan:
the segment 'root root rel1 rel2 ...' the oracle writes, gyms/memory.py), and is its part of the
final answer right (the gym's exact match, part by part, of an answer the episode stopped on). A
wrong plan is counted as shorter, longer or other: fewer, more or as many words as the right one
(hops dropped, added or swapped, when the plan is this objective's). Prints one line per split,
number of parts k and objective j (1 = first).

    python scripts/memory_plans.py out/val_Q_s40/ckpt_000000.pt out/val_Q_s40/ckpt_000060.pt

A plan is read from the first segment of any turn's <mem> that starts with the objective's root
written twice; a later rewrite of it does not count, and a policy that writes its memory another way
opens nothing by this count. An episode that did not stop on an answer (out of turns, or its last
answer turn refused as malformed) answers nothing.
"""
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gym import fail
from gyms import memory as gm
from gyms.answers import em, extract_answer, extract_mem

COLUMNS = ('opened', 'plan_right', 'plan_shorter', 'plan_longer', 'plan_other', 'answered', 'right', 'right_after_right_plan')


def part_outcomes(task, actions, answered=True):
    """Per objective of a memory task, in the question's order: dict of bools (COLUMNS: a wrong plan is
    plan_shorter, plan_longer or plan_other as it has fewer, more or as many words as the right one),
    from the episode's decoded policy turns `actions` (list[str]); answered=False: the episode did not
    stop on an answer, so no part is answered."""
    segments = [s.split() for a in actions for s in (extract_mem('<mem> ' + a) or '').split(';')]
    answer = extract_answer(actions[-1]) if actions and answered else None
    parts = [p.strip() for p in answer.split(';')] if answer is not None else []
    out = []
    for j, question in enumerate(task.question.split(' ; ')):
        plan = gm._pending_chain(question).split()
        seg = next((s for s in segments if s[:2] == plan[:2]), None)
        got = parts[j] if j < len(parts) else ''
        right = bool(got) and em(got, task.golds[j]) == 1.0
        wrong = seg is not None and seg != plan
        out.append(dict(opened=seg is not None, plan_right=seg == plan, plan_shorter=wrong and len(seg) < len(plan),
                        plan_longer=wrong and len(seg) > len(plan), plan_other=wrong and len(seg) == len(plan),
                        answered=bool(got), right=right, right_after_right_plan=right and seg == plan))
    return out


def tally(trajs, split):
    """{(split, k, j): Counter of COLUMNS and 'n'} over trajectories (their task, info['actions'] and
    info['stop'])."""
    rows = {}
    for t in trajs:
        outcomes = part_outcomes(t.task, t.info['actions'], t.info.get('stop') == 'answer')
        for j, o in enumerate(outcomes, 1):
            c = rows.setdefault((split, len(outcomes), j), Counter())
            c['n'] += 1
            c.update({k: int(v) for k, v in o.items()})
    return rows


if __name__ == '__main__':
    usage = __doc__.strip().split('\n\n')[1].strip()
    if any(a in ('-h', '--help') for a in sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    if len(sys.argv) < 2 or any(a.startswith('-') for a in sys.argv[1:]):
        fail(f"usage: {usage}  (checkpoint files; no options)")
    for path in sys.argv[1:]:  # every path before any evaluation
        if not os.path.isfile(path):
            fail(f"memory_plans.py: {path}: no such file (a run's checkpoints are out_dir/ckpt_<step>.pt)")
    import sample
    for path in sys.argv[1:]:
        cfg, gym_, model, _, _ = sample.load_run([], ckpt=path)
        if cfg['gym'] != 'memory':
            fail(f"memory_plans.py: {path} is a {cfg['gym']} run; plans are the memory gym's")
        for split in ('heldout', 'val'):
            if not gym_.get(sample.SPLITS[split]):  # no validation tasks (val_tasks: 0)
                continue
            _, trajs = sample.evaluate(model, gym_, cfg, samples=1, greedy=True, split=split)
            for (s, k, j), c in sorted(tally(trajs, split).items()):
                print(f"{path} {s} k={k} part {j}: {c['n']} tasks, " + ', '.join(f'{name} {c[name]}' for name in COLUMNS))
