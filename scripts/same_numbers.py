"""
Do two runs print the same numbers? Compares two metrics.jsonl files line by line, key by key, and
exits 1 naming the first difference. The machine's keys (report.MACHINE_KEYS: times, speed, memory)
are skipped; every other number must be equal to the last bit.

    python scripts/same_numbers.py out/before/metrics.jsonl out/after/metrics.jsonl

A restructure that moves code without changing the algorithm must pass this on short runs of
config/tiny.yaml and config/tiny_mem.yaml at the same seed (docs/RESULTS.md lists the commands).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from report import MACHINE_KEYS


def differences(a_path, b_path):
    """[message] for each step line whose keys or values differ (timings aside)."""
    a, b = [[json.loads(line) for line in open(p)] for p in (a_path, b_path)]
    out = [] if len(a) == len(b) else [f'{len(a)} lines against {len(b)}']
    for x, y in zip(a, b):
        x, y = ({k: v for k, v in r.items() if k not in MACHINE_KEYS} for r in (x, y))
        if x.keys() != y.keys():
            out.append(f"step {x.get('step')}: keys differ: {sorted(set(x) ^ set(y))}")
        out += [f"step {x['step']}: {k} {x[k]!r} against {y[k]!r}" for k in x if k in y and x[k] != y[k]]
    return out


if __name__ == '__main__':
    diffs = differences(*sys.argv[1:3])
    print('\n'.join(diffs) if diffs else f'same numbers: {sys.argv[1]} and {sys.argv[2]}')
    sys.exit(1 if diffs else 0)
