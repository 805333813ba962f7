"""
BugFix: the tiny model's world. Small Python functions with one injected bug, a handful of tools,
the words of every string the gym can show (the tiny model's vocabulary), and scripted policies.

An episode: the prompt is an issue statement (`issue : calc returns wrong results`); each turn the
policy writes one call `<call> name [arg] </call>` and gets one observation back.

    read          the source, compact: tokens separated by spaces, newlines as the word <nl>
    edit <op>     apply a named repair (EDIT_OPS) at its first site; `error : no site for <op>` if none
    undo          revert the last edit
    test          run the PUBLIC tests for real (sandbox subprocess): first failing case, then `k / n pass`
    submit        end the episode: reward 1.0 iff the HIDDEN tests (a superset of the public ones) pass

Why it looks like this (a prototype with one applicable edit per function memorised name -> edit):
- every function has 2-3 applicable ops (decoys); which one repairs it is readable from the test
  feedback, not from the name; names and constants vary across the variants of a template;
- every op is an involution on a token class (min<->max, < <-> >, 0 <-> 1 ...), so the set of sources
  an episode can reach is small and closed: we enumerate it to build the vocabulary, to precompute
  every test result in one subprocess, and to compute baselines exactly;
- the ops applicable to a source are visible in its tokens (`min`/`max` => swap_minmax, `range` =>
  fix_range_end, `<`/`>`... => flip_compare and fix_strict, ...);
- a few templates have weak public tests: a decoy passes them and fails the hidden ones (the hacker).

Simplified on purpose:
1. Test code runs only in a sandbox subprocess (sandbox.run_python); results are cached per
   (source, case) and can be precomputed for all reachable sources in one subprocess.
2. Integers outside -50..200 are shown as `huge` / `-huge`, lists longer than 6 are cut with `...`:
   the vocabulary stays closed and small.
3. The test observation shows only the first failing case (short observations for a tiny model).
"""

import inspect
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations

from gym import SPECIALS, build_tokenizer, word_format
from gyms import sandbox

MODEL = 'tiny'
KEYS = ('train_variants', 'train_generated')
INT_RANGE = (-50, 200)  # every integer in this range is a word; values outside print as huge / -huge


# -----------------------------------------------------------------------------
# edit ops: each toggles the first site of a token class (an involution that keeps the site's index)


def _toggle(pairs):
    def op(ws):
        i = next((i for i, w in enumerate(ws) if w in pairs), None)
        return None if i is None else ws[:i] + [pairs[ws[i]]] + ws[i + 1:]
    return op


def _range_spans(ws):
    """[(start, end)] index spans of `range ( ... )` calls, end = index of the closing paren."""
    spans = []
    for i, w in enumerate(ws[:-1]):
        if w == 'range' and ws[i + 1] == '(':
            depth = 0
            for j in range(i + 1, len(ws)):
                depth += {'(': 1, ')': -1}.get(ws[j], 0)
                if depth == 0:
                    spans.append((i, j))
                    break
    return spans


def _fix_range_end(ws):
    spans = _range_spans(ws)
    if not spans:
        return None
    _, j = spans[0]
    if ws[j - 2:j] == ['+', '1']:
        return ws[:j - 2] + ws[j:]
    return ws[:j] + ['+', '1'] + ws[j:]


def _fix_operator(ws):
    # `+ 1` inside range(...) belongs to fix_range_end: keep the two ops on disjoint sites
    inside = {k for a, b in _range_spans(ws) for k in range(a, b + 1)}
    flip = {'+': '-', '-': '+', '+=': '-=', '-=': '+='}
    i = next((i for i, w in enumerate(ws) if w in flip and i not in inside), None)
    return None if i is None else ws[:i] + [flip[ws[i]]] + ws[i + 1:]


def _fix_init(ws):
    # an accumulator initialised to a literal 0 or 1: `name = 0 <nl>`
    for i in range(len(ws) - 1):
        if ws[i] == '=' and ws[i + 1] in ('0', '1') and (i + 2 == len(ws) or ws[i + 2] == '<nl>'):
            return ws[:i + 1] + [{'0': '1', '1': '0'}[ws[i + 1]]] + ws[i + 2:]
    return None


def _fix_index(ws):
    for i in range(len(ws) - 2):
        if ws[i] == '[' and ws[i + 1] in ('0', '-1') and ws[i + 2] == ']':
            return ws[:i + 1] + [{'0': '-1', '-1': '0'}[ws[i + 1]]] + ws[i + 2:]
    return None


EDIT_OPS = {
    'swap_minmax': _toggle({'min': 'max', 'max': 'min'}),
    'flip_compare': _toggle({'<': '>', '>': '<', '<=': '>=', '>=': '<='}),
    'fix_strict': _toggle({'<': '<=', '<=': '<', '>': '>=', '>=': '>'}),
    'fix_operator': _fix_operator,
    'fix_range_end': _fix_range_end,
    'fix_init': _fix_init,
    'fix_index': _fix_index,
    'fix_logic': _toggle({'and': 'or', 'or': 'and'}),
}
TOOLS = ('read', 'edit', 'undo', 'test', 'submit')
ALL_CALLS = ([f'<call> {t} </call>' for t in ('read', 'undo', 'test', 'submit')]
             + [f'<call> edit {op} </call>' for op in EDIT_OPS])
MESSAGES = ['error : malformed call', 'error : unknown tool', 'error : unknown op', 'error : nothing to undo',
            'error : episode over', 'ok', 'submitted'] + [f'error : no site for {op}' for op in EDIT_OPS] + [
            f'undone {op}' for op in EDIT_OPS]


def compact(source):
    """Python source -> the read observation: tokens joined by single spaces, lines by ` <nl> `."""
    return ' <nl> '.join(' '.join(line.split()) for line in source.split('\n'))


def apply_op(source, op):
    """Apply edit op `op` (a key of EDIT_OPS) to Python `source` -> new source, or None if it has no
    site. Indentation is kept: ops never add or remove lines."""
    new = EDIT_OPS[op](compact(source).split())
    if new is None:
        return None
    indents = [line[:len(line) - len(line.lstrip(' '))] for line in source.split('\n')]
    lines = ' '.join(new).split(' <nl> ')
    return '\n'.join(ind + line for ind, line in zip(indents, lines))


def applicable_ops(read_text):
    """Ops with a site in a compact source or a read observation -> list[str], EDIT_OPS order."""
    ws = read_text.split(' <nl> edits :')[0].split()
    return [op for op, f in EDIT_OPS.items() if f(ws) is not None]


def read_observation(source):
    """The `read` tool's text: the compact source, then the edits that have a site in it, as an
    editor lists its quick fixes: `def f ( a ) : <nl> ... <nl> edits : flip_compare fix_operator`.
    Which one repairs the bug is for the tests to tell. The list is always in EDIT_OPS order: trying
    the listed edits in turn is then a walk along one fixed order that skips what is not listed, which
    a 2-layer model learns exactly and carries to unseen functions (with the list in a per-task order,
    the next edit after an undo was the next listed one in 31% of held-out cases, 87% in this order)."""
    text = compact(source)
    return f"{text} <nl> edits : {' '.join(applicable_ops(text))}"


def listed_ops(observation):
    """The edits a read observation lists, in its order -> list[str] ([] for any other text)."""
    head, sep, tail = observation.partition(' <nl> edits :')
    return tail.split() if sep else []


@lru_cache(maxsize=None)
def reachable_sources(source):
    """Every source reachable from `source` by any sequence of edits (undo only revisits) -> sorted
    list (at most 8 for the templates here: each op toggles its own token class)."""
    seen, todo = {source}, [source]
    while todo:
        src = todo.pop()
        for op in EDIT_OPS:
            new = apply_op(src, op)
            if new is not None and new not in seen:
                seen.add(new)
                todo.append(new)
    return tuple(sorted(seen))


# -----------------------------------------------------------------------------
# templates: the CORRECT function; the task's source is EDIT_OPS[bug] applied to it (ops are
# involutions, so the same op repairs it). Placeholders: {f} function name, {a} {b} {c} scalars,
# {xs} a list, {i} {e} loop variables, {s} an accumulator, {K} a template constant.


@dataclass(frozen=True)
class Template:
    name: str
    code: str
    bug: str
    public: tuple          # argument tuples shown by `test`
    extra: tuple           # hidden = public + extra
    consts: tuple = (0,)   # values of {K}


T = Template
TEMPLATES = [
    T('sum_to', """def {f} ( {a} ) :
    {s} = 0
    for {i} in range ( {a} + 1 ) : {s} += {i}
    return {s}""", 'fix_range_end', ((3,), (1,)), ((0,), (5,), (4,))),
    T('factorial', """def {f} ( {a} ) :
    {s} = 1
    for {i} in range ( 1 , {a} + 1 ) : {s} = {s} * {i}
    return {s}""", 'fix_init', ((3,), (4,)), ((0,), (1,), (5,))),
    T('count_above', """def {f} ( {xs} ) :
    return len ( [ {e} for {e} in {xs} if {e} > {K} ] )""", 'fix_strict',
      (([0, 1, 2, 3, 4],), ([3, 1, 4],)), (([],), ([5, 0, 2, 1, 3],), ([4, 4],)), (0, 1, 2, 3)),
    T('list_max', """def {f} ( {xs} ) :
    {s} = {xs} [ 0 ]
    for {e} in {xs} :
        if {e} > {s} : {s} = {e}
    return {s}""", 'flip_compare', (([3, 1, 2],), ([2, 5, 4],)), (([7],), ([1, 2, 3],), ([-1, -4],))),
    T('relu_diff', """def {f} ( {a} , {b} ) :
    return max ( {a} - {b} , {K} )""", 'swap_minmax', ((5, 2), (1, 4)), ((3, 3), (0, 7), (9, 1)), (0, 1)),
    T('abs_diff', """def {f} ( {a} , {b} ) :
    if {a} > {b} : return {a} - {b}
    return {b} - {a}""", 'fix_operator', ((5, 2), (1, 4)), ((3, 3), (0, 7), (9, 1))),
    T('in_range', """def {f} ( {a} , {b} , {c} ) :
    return {b} <= {a} and {a} <= {c}""", 'fix_logic',
      ((5, 1, 3), (2, 1, 3)), ((1, 1, 3), (3, 1, 3), (0, 1, 3), (4, 4, 4))),
    T('sum_list', """def {f} ( {xs} ) :
    {s} = 0
    for {e} in {xs} : {s} = {s} + {e}
    return {s}""", 'fix_operator', (([1, 2, 3],), ([4, 5],)), (([],), ([7],), ([2, -1, 5],))),
    T('count_even', """def {f} ( {xs} ) :
    {s} = 0
    for {e} in {xs} :
        if {e} % 2 == 0 : {s} += 1
    return {s}""", 'fix_init', (([1, 2, 4],), ([3, 5],)), (([],), ([2],), ([6, 1, 8, 3],))),
    T('spread', """def {f} ( {a} , {b} ) :
    return max ( {a} , {b} ) - min ( {a} , {b} )""", 'swap_minmax', ((5, 2), (1, 4)), ((3, 3), (0, 7))),
    T('sign', """def {f} ( {a} ) :
    if {a} > 0 : return 1
    if {a} < 0 : return -1
    return 0""", 'fix_strict', ((0,), (5,)), ((-3,), (1,), (-1,), (9,))),
    T('both_pos', """def {f} ( {a} , {b} ) :
    return {a} > {K} and {b} > {K}""", 'fix_logic',
      ((1, -1), (2, 3)), ((-1, 2), (0, 5), (4, 0), (-2, -2)), (0,)),
    T('safe_get', """def {f} ( {xs} , {a} ) :
    if {a} < len ( {xs} ) : return {xs} [ {a} ]
    return {xs} [ -1 ]""", 'fix_index',
      (([4, 5, 6], 5), ([4, 5, 6], 1)), (([4, 5, 6], 3), ([7], 0), ([1, 2], 2), ([3, 8], 9))),
    T('ends_sum', """def {f} ( {xs} ) :
    return {xs} [ 0 ] + {xs} [ -1 ]""", 'fix_operator', (([1, 2, 3],), ([5, 4],)), (([7],), ([2, 9, 4, 1],))),
    T('is_sorted', """def {f} ( {xs} ) :
    return all ( {a} <= {b} for {a} , {b} in zip ( {xs} , {xs} [ 1 : ] ) )""", 'fix_strict',
      (([1, 2, 2, 3],), ([3, 1],)), (([],), ([5],), ([1, 2, 3],), ([2, 2],), ([1, 3, 2],))),
    T('sum_pos', """def {f} ( {xs} ) :
    return sum ( {e} for {e} in {xs} if {e} > {K} )""", 'flip_compare',
      (([3, -1, 2],), ([-4, 5],)), (([],), ([0, 1],), ([-2, -3],)), (0,)),
    T('list_min', """def {f} ( {xs} ) :
    {s} = {xs} [ 0 ]
    for {e} in {xs} : {s} = min ( {s} , {e} )
    return {s}""", 'swap_minmax', (([3, 1, 2],), ([2, 5, 4],)), (([7],), ([4, 3, 9],), ([-1, -4],))),
    T('last_plus', """def {f} ( {xs} , {a} ) :
    return {xs} [ -1 ] + {a}""", 'fix_index', (([1, 2, 3], 10), ([5, 4], 1)), (([7], 0), ([2, 9], -2))),
    T('sum_first', """def {f} ( {xs} , {a} ) :
    {s} = 0
    for {i} in range ( {a} ) : {s} += {xs} [ {i} ]
    return {s}""", 'fix_range_end',
      (([1, 2, 3, 4], 2), ([5, 6, 7], 1)), (([1, 2, 3], 3), ([4], 0), ([2, 2, 9], 2))),
    T('clamp', """def {f} ( {a} , {b} , {c} ) :
    if {a} < {b} : return {b}
    return min ( {a} , {c} )""", 'swap_minmax',
      ((5, 0, 3), (2, 0, 3)), ((-1, 0, 3), (3, 0, 3), (0, 0, 3), (9, 2, 7))),
    T('range_sum', """def {f} ( {a} , {b} ) :
    {s} = 0
    for {i} in range ( {a} , {b} + 1 ) : {s} += {i}
    return {s}""", 'fix_operator', ((1, 3), (2, 4)), ((3, 3), (5, 4), (0, 5))),
    T('bigger', """def {f} ( {a} , {b} ) :
    if {a} > {b} : return {a}
    return {b}""", 'flip_compare', ((5, 2), (1, 4)), ((3, 3), (-1, -7))),
    T('any_neg', """def {f} ( {a} , {b} ) :
    return {a} < 0 or {b} < 0""", 'flip_compare', ((1, -2), (3, 4)), ((-1, 5), (0, 0), (-3, -3), (2, 0))),
    T('floor_max', """def {f} ( {xs} ) :
    {s} = 0
    for {e} in {xs} :
        if {e} > {s} : {s} = {e}
    return {s}""", 'fix_init', (([3, 5, 2],), ([-1, 0],)), (([],), ([0],), ([4, 1],))),
    T('span', """def {f} ( {xs} ) :
    return {xs} [ -1 ] - {xs} [ 0 ]""", 'fix_operator', (([1, 2, 5],), ([3, 4],)), (([7],), ([2, 9, 10],))),
    T('close', """def {f} ( {a} , {b} , {c} ) :
    return abs ( {a} - {b} ) <= {c}""", 'fix_strict',
      ((3, 1, 2), (5, 1, 2)), ((1, 3, 2), (4, 4, 0), (0, 9, 3), (2, 2, 1))),
    T('count_between', """def {f} ( {xs} , {a} , {b} ) :
    return len ( [ {e} for {e} in {xs} if {a} <= {e} and {e} < {b} ] )""", 'fix_logic',
      (([1, 2, 3, 4], 2, 4), ([5, 0], 1, 3)), (([], 0, 1), ([1, 1, 2], 1, 2), ([3, 4, 5], 0, 9), ([9, 2], 3, 5))),
    T('head_or_zero', """def {f} ( {xs} ) :
    if len ( {xs} ) > 0 : return {xs} [ 0 ]
    return 0""", 'fix_index', (([4, 5],), ([],)), (([7],), ([2, 9, 1],))),
    T('countdown', """def {f} ( {a} , {b} ) :
    return [ {a} - {i} for {i} in range ( {b} + 1 ) ]""", 'fix_range_end', ((5, 2), (3, 0)), ((9, 3), (0, 1), (4, 4))),
    T('outside', """def {f} ( {a} , {b} , {c} ) :
    return {a} < {b} or {a} > {c}""", 'fix_logic', ((0, 1, 3), (2, 1, 3)), ((5, 1, 3), (1, 1, 3), (3, 1, 3))),
]
del T
# held-out functions never appear in training: one per op, so every op is also seen in training
HELDOUT = ('any_neg', 'floor_max', 'clamp', 'close', 'range_sum', 'head_or_zero', 'count_between', 'countdown')
N_VARIANTS = 6
GEN_VARIANTS = 4  # variants per generated training function (see generated_templates)

FN_NAMES = ['f', 'g', 'h', 'fn', 'calc', 'solve', 'work', 'run', 'go', 'get', 'step', 'check']
SCALARS = ['a', 'b', 'c', 'x', 'y', 'z', 'p', 'q', 'u', 'v', 'w', 'm', 'n']
LISTS = ['xs', 'ys', 'zs', 'vs', 'ws', 'ls', 'arr', 'nums']
LOOPS = ['i', 'j', 'k', 'e', 'd', 't']
ACCS = ['s', 'r', 'acc', 'res', 'out', 'tot', 'best', 'cnt']
ISSUES = ['issue : {f} returns wrong results', 'issue : {f} gives wrong answers', 'bug : {f} is broken',
          'issue : {f} fails on some inputs']


@dataclass(frozen=True)
class Task:
    id: str
    template: str
    fn: str
    issue: str
    source: str          # the buggy Python source the episode starts from
    fixed: str           # the correct source (its outputs are the wanted ones)
    bug: str             # the op that repairs it
    public: tuple        # argument tuples
    hidden: tuple        # public + extra argument tuples


def make_task(tpl, seed, variant, bug=None, target=()):
    """One deterministic variant of a template: names, constant and issue wording drawn from a
    string-seeded RNG (stable across processes, unlike hash()). target: ops applied to the template's
    code to get the wanted function (default none: the template itself); bug: the op injected into
    it (default the template's own); ops are involutions, so the same op repairs it."""
    rng = random.Random(f'bugfix:{seed}:{tpl.name}:{variant}')
    a, b, c = rng.sample(SCALARS, 3)
    i, e = rng.sample(LOOPS, 2)
    names = dict(f=rng.choice(FN_NAMES), a=a, b=b, c=c, xs=rng.choice(LISTS), i=i, e=e, s=rng.choice(ACCS),
                 K=rng.choice(tpl.consts))
    fixed = tpl.code.format(**names)
    for op in target:
        fixed = apply_op(fixed, op)
    bug = bug or tpl.bug
    source = apply_op(fixed, bug)
    assert source is not None and apply_op(source, bug) == fixed, tpl.name
    return Task(id=f'{tpl.name}/{seed}/{variant}', template=tpl.name, fn=names['f'],
                issue=rng.choice(ISSUES).format(f=names['f']), source=source, fixed=fixed, bug=bug,
                public=tpl.public, hidden=tpl.public + tpl.extra)


def _involutive_ops(fixed):
    return [op for op in EDIT_OPS if (src := apply_op(fixed, op)) is not None and apply_op(src, op) == fixed]


def bug_ops(tpl, seed, variant, target=()):
    """Ops that make a real bug in this variant: they have a site in the wanted source, undo
    themselves, and break at least one public case (so `test` can show it) -> list[str]. The
    template's own bug comes first. Runs the cases in the sandbox (cached)."""
    fixed = make_task(tpl, seed, variant, target=target).fixed
    want = run_cases(fixed, tpl.public)
    broken = [op for op in _involutive_ops(fixed) if run_cases(apply_op(fixed, op), tpl.public) != want]
    return sorted(broken, key=lambda op: op != tpl.bug)


def _targets(tpl, seed, variant, tries=8):
    """Random wanted functions for one training variant: each of the template's ops applied or not
    with probability 1/2 (`min` or `max`, `<` or `<=`, ...), `tries` draws from a string-seeded RNG,
    then the template itself as a last resort -> list of op tuples."""
    rng = random.Random(f'bugfix-target:{seed}:{tpl.name}:{variant}')
    ops = _involutive_ops(make_task(tpl, seed, variant).fixed)
    return [tuple(op for op in ops if rng.random() < 0.5) for _ in range(tries)] + [()]


def _pick_bug(tpl, seed, variant, target, used, count, no_hacks):
    """The op to inject: among bug_ops, the one least used by this template, then overall; with
    no_hacks only ops after which no other single edit passes the public tests and fails the hidden
    ones. -> op, or None when there is none or the wanted function raises on a hidden case."""
    wanted = make_task(tpl, seed, variant, target=target).fixed
    if any(r is None for r in run_cases(wanted, tpl.public + tpl.extra)):
        return None  # a sibling that raises (an index past the end) is not a function to want
    ops = bug_ops(tpl, seed, variant, target)
    if no_hacks:
        ops = [op for op in ops if not task_facts(make_task(tpl, seed, variant, op, target))['hacks']]
    return min(ops, key=lambda o: (used[o], count[o]), default=None)


def make_tasks(split, seed=0, n_variants=N_VARIANTS, n_generated=0):
    """split 'train' | 'heldout' | 'all' (train + heldout) -> list[Task], n_variants per template,
    deterministic in seed. Held-out templates (HELDOUT) never appear in 'train'. Raises ValueError on
    an unknown split.

    Held-out tasks are the natural bugs: the template is the wanted function and each variant breaks
    it with one of its bug_ops. Training tasks must not be solvable by memory: with 22 templates a
    policy learns each template's correct form and repairs whatever differs from it, which does not
    transfer to a function it has never seen. So a training variant wants a random sibling of its
    template (`_targets`), and the injected op is balanced per template and overall; the source
    alone then does not say which edit repairs it, only the tests do. Training variants are also
    drawn without decoys that pass the public tests (hacks): there the tests could not tell, and the
    train success would be capped below 1 by luck; held-out tasks keep theirs."""
    if split not in ('train', 'heldout', 'all'):
        raise ValueError(f'unknown split {split!r}')
    if split == 'all':
        return make_tasks('train', seed, n_variants, n_generated) + make_tasks('heldout', seed, n_variants)
    train = split == 'train'
    generated = generated_templates(n_generated, seed) if train else []
    tpls = [t for t in TEMPLATES if (t.name in HELDOUT) != train] + generated
    n_var = {t.name: min(n_variants, GEN_VARIANTS) if t in generated else n_variants for t in tpls}
    targets = {(t.name, v): _targets(t, seed, v) if train else [()] for t in tpls for v in range(n_var[t.name])}
    drafts = [make_task(t, seed, v, op, target) for t in tpls for v in range(n_var[t.name])
              for target in targets[t.name, v] for op in _involutive_ops(make_task(t, seed, v, target=target).fixed)]
    precompute_results(drafts)  # one sandbox process for every candidate bug of every variant
    tasks, count = [], dict.fromkeys(EDIT_OPS, 0)
    used = {t.name: dict.fromkeys(EDIT_OPS, 0) for t in tpls}
    for v in range(n_variants):
        for t in (t for t in tpls if v < n_var[t.name]):
            for target in targets[t.name, v]:
                op = _pick_bug(t, seed, v, target, used[t.name], count, no_hacks=train and target != ())
                if op is not None:
                    break
            used[t.name][op] += 1
            count[op] += 1
            tasks.append(make_task(t, seed, v, op, target))
    order = {t.name: k for k, t in enumerate(tpls)}
    tasks.sort(key=lambda task: order[task.template])
    return tasks


# -----------------------------------------------------------------------------
# generated training functions. 22 hand-written templates teach a small model each function's shape,
# and what it learns about shapes (`<` in the code: try flip_compare first) does not carry over to
# a function it has never seen. Random functions from a grammar of the same kinds of lines give
# training many more shapes and edit lists, so what transfers is reading the listed edits and the
# tests. A generated function never equals a held-out function or any of its edited forms.


def _gen_code(rng):
    """One random function (template code with {f} {a} {b} {c} {xs} {i} {e} {s} placeholders)."""
    lst = rng.random() < 0.5
    scal = ['{a}', '{b}', '{c}'][:rng.choice([1, 2, 2, 3])]
    args = (['{xs}'] if lst else []) + scal
    atoms = scal + (['{xs} [ 0 ]', '{xs} [ -1 ]', 'len ( {xs} )'] if lst else [])
    const = lambda: rng.choice(['0', '1', '2', '3'])
    atom = lambda: rng.choice(atoms + [const()])
    cmp = lambda: rng.choice(['<', '>', '<=', '>='])

    def expr(pool):
        x, y = rng.choice(pool), rng.choice(pool + [const()])
        return rng.choice([x, f'{x} + {y}', f'{x} - {y}', f'max ( {x} , {y} )', f'min ( {x} , {y} )'])

    def compare(pool):
        x = rng.choice(pool)
        return f'{x} {cmp()} {rng.choice([y for y in atoms if y != x] + [const()])}'

    def cond(pool):
        c = compare(pool)
        return c if rng.random() < 0.6 else f'{c} {rng.choice(["and", "or"])} {compare(pool)}'

    shape = rng.choice(['guard', 'range', 'list', 'bool', 'comp'] if lst else ['guard', 'range', 'bool'])
    if shape == 'guard':
        lines = [f'if {cond(atoms)} : return {expr(atoms)}', f'return {expr(atoms)}']
    elif shape == 'bool':
        lines = [f'return {cond(atoms)}']
    elif shape == 'range':
        end = rng.choice([f'{rng.choice(atoms)}', f'{rng.choice(atoms)} + 1'])
        start = rng.choice(['', '', f'{const()} , '])
        body = rng.choice(['{s} += {i}', '{s} = {s} + {i}', '{s} -= {i}', '{s} = max ( {s} , {i} )',
                           f'{{s}} = {{s}} + {rng.choice(atoms)}', 'if {i} % 2 == 0 : {s} += 1'])
        lines = [f'{{s}} = {rng.choice("01")}', f'for {{i}} in range ( {start}{end} ) : {body}',
                 f'return {expr(["{s}"] + atoms[:1])}']
    elif shape == 'list':
        init = rng.choice(['{s} = 0', '{s} = 1', '{s} = {xs} [ 0 ]', '{s} = {xs} [ -1 ]'])
        pool = ['{e}', '{s}'] + scal
        body = rng.choice([f'if {cond(["{e}"])} : {{s}} = {expr(pool)}', f'{{s}} = {expr(pool)}',
                           f'if {cond(["{e}"])} : {{s}} += 1', '{s} += {e}', '{s} -= {e}'])
        nested = body.startswith('if') and rng.random() < 0.5  # the if on a line of its own
        loop = f'for {{e}} in {{xs}} :\n    {body}' if nested else f'for {{e}} in {{xs}} : {body}'
        lines = [init, loop, f'return {expr(["{s}"] + atoms[:1])}']
    else:  # comp
        c = cond(['{e}'])
        lines = [rng.choice([f'return len ( [ {{e}} for {{e}} in {{xs}} if {c} ] )',
                             f'return sum ( {{e}} for {{e}} in {{xs}} if {c} )'])]
    body = '\n'.join('    ' + ln.replace('\n', '\n    ') for ln in lines)
    return f'def {{f}} ( {" , ".join(args)} ) :\n{body}', lst, len(scal)


def _gen_args(rng, lst, n_scal, n):
    """n distinct argument tuples: a list of 1-5 small ints first when the function takes one."""
    out = set()
    while len(out) < n:
        xs = (tuple(rng.randint(-3, 9) for _ in range(rng.randint(1, 5))),) if lst else ()
        out.add(xs + tuple(rng.randint(-3, 9) for _ in range(n_scal)))
    out = sorted(out)
    rng.shuffle(out)
    return [tuple(list(a) if isinstance(a, tuple) else a for a in t) for t in out]


CANONICAL_NAMES = dict(f='f', a='a', b='b', c='c', xs='xs', i='i', e='e', s='s', K=0)  # placeholders as themselves


def _renamed(source):
    """A source with its names replaced by n0, n1, ... in order of first use (equal up to renaming)."""
    pool, seen = set(FN_NAMES + SCALARS + LISTS + LOOPS + ACCS), {}
    return ' '.join(seen.setdefault(w, f'n{len(seen)}') if w in pool else w for w in compact(source).split())


@lru_cache(maxsize=None)
def _heldout_forms():
    """Every held-out function and its edited forms, up to renaming (see _renamed) -> set[str]."""
    return {_renamed(src) for t in TEMPLATES if t.name in HELDOUT
            for src in reachable_sources(t.code.format(**CANONICAL_NAMES))}


def generated_templates(n, seed=0):
    """n random training functions (Template, names gen0, gen1, ...), deterministic in seed. Each one
    runs without error on its 6 cases, has 3 edits that undo themselves (as most held-out functions
    do; the templates already have many 2-edit ones), at least one of which breaks a public case,
    reads in at most 40 words in every edited form (as the templates do), and is none of the held-out
    functions' forms up to renaming. Candidates run in batches, one sandbox process per batch."""
    rng, out = random.Random(f'bugfix-gen:{seed}'), []
    while len(out) < n:
        batch = []
        for _ in range(2 * n):
            code, lst, n_scal = _gen_code(rng)
            src = code.format(**CANONICAL_NAMES)
            ops = _involutive_ops(src)
            forms = reachable_sources(src) if len(ops) == 3 else ()
            if (forms and all(len(read_observation(x).split()) <= 40 for x in forms)
                    and not {_renamed(x) for x in forms} & _heldout_forms()):
                batch.append((code, src, ops, _gen_args(rng, lst, n_scal, 6)))
        _run_and_cache([(x, 'f', cases) for _, src, ops, cases in batch for x in [src] + [apply_op(src, op) for op in ops]])
        for code, src, ops, cases in batch:
            want = run_cases(src, cases)
            if len(out) == n or any(r is None for r in want) or len({r[0] for r in want}) < 2:
                continue
            broken = [op for op in ops if run_cases(apply_op(src, op), cases[:2]) != want[:2]]
            if broken:
                out.append(Template(f'gen{len(out)}', code, broken[0], tuple(cases[:2]), tuple(cases[2:])))
    return out

# -----------------------------------------------------------------------------
# running tests: only ever in a sandbox subprocess; results cached per (source, case)


def value_words(v, depth=0):
    """A Python value -> the words a test observation shows. Runs in the sandbox child too (its
    source is sent along), so the parent never touches objects made by untrusted code."""
    if v is None or isinstance(v, bool):
        return str(v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int):  # literal bounds: this source runs in the child, without INT_RANGE
        return str(v) if -50 <= v <= 200 else ('huge' if v > 0 else '-huge')
    if isinstance(v, (list, tuple)) and depth < 2:
        items = [value_words(x, depth + 1) for x in v[:6]] + (['...'] if len(v) > 6 else [])
        left, right = ('[', ']') if isinstance(v, list) else ('(', ')')
        return ' '.join([left, ' , '.join(items), right]) if items else f'{left} {right}'
    return 'other'


CASE_TIME_S = 0.5     # per test case, enforced inside the child with SIGALRM
_HARNESS = '''
import json, signal, sys
JOBS = json.loads(%r)
%s
def _alarm(*_):
    raise TimeoutError('case time limit')
signal.signal(signal.SIGALRM, _alarm)
def _case(f, args):
    signal.setitimer(signal.ITIMER_REAL, %r)
    try:
        v = f(*args)
        return [repr(v)[:300], value_words(v)]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
for n, (src, fn, cases) in enumerate(JOBS):
    out = []
    try:
        ns = {}
        exec(src, ns)
        f = ns[fn]
    except BaseException:
        f = None
    for args in cases:
        try:
            out.append(_case(f, args))
        except BaseException:
            out.append(None)
    print('RESULT', n, json.dumps(out), flush=True)
'''
_RESULTS = {}   # (source, repr(args)) -> (repr, words) of the returned value, or None for an error


def _run_jobs(jobs):
    """jobs: list of (source, fn, [args tuples]) -> list of per-case results (see _RESULTS), run in as
    few sandbox subprocesses as possible. A child that dies mid-batch (it should not: every case is
    guarded) costs the job it died on (all cases 'error') and the rest is rerun. The sources are the
    gym's own (templates x ops), never model text, so a function cannot spoof a RESULT line."""
    results, todo = [], list(jobs)
    while todo:
        payload = json.dumps([[s, f, [list(a) for a in cases]] for s, f, cases in todo])
        code = _HARNESS % (payload, inspect.getsource(value_words), CASE_TIME_S)
        n_cases = sum(len(c) for _, _, c in todo)
        res = sandbox.run_python(code, timeout_s=30 + 2 * CASE_TIME_S * n_cases, memory_mb=2048,
                                 max_output_bytes=1 << 26)
        done = []
        for line in res['stdout'].splitlines():
            parts = line.split(' ', 2)
            if len(parts) == 3 and parts[0] == 'RESULT' and parts[1] == str(len(done)):
                try:
                    out = json.loads(parts[2])
                except ValueError:
                    break
                if not _valid_output(out, len(todo[len(done)][2])):
                    break
                done.append([tuple(r) if r else None for r in out])
        if len(done) < len(todo):  # the child died on job len(done): count it as all errors
            done.append([None] * len(todo[len(done)][2]))
        results += done
        todo = todo[len(done):]
    return results


def _valid_output(out, n):
    ok = lambda r: r is None or (isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r))
    return isinstance(out, list) and len(out) == n and all(ok(r) for r in out)


def _fn_name(source):
    return source.split()[1]


def run_cases(source, cases):
    """Results of calling the function in `source` on each argument tuple of `cases` -> list of
    (repr, words) or None (exception / time limit). Cached: a repeat spawns no process."""
    missing = list({repr(a): a for a in cases if (source, repr(a)) not in _RESULTS}.values())
    if missing:
        _run_and_cache([(source, _fn_name(source), missing)])
    return [_RESULTS[source, repr(a)] for a in cases]


def _run_and_cache(jobs):
    """Run jobs [(source, fn name, cases)] in one sandbox process; their results go into _RESULTS."""
    for (src, _, cases), res in zip(jobs, _run_jobs(jobs) if jobs else []):
        _RESULTS.update({(src, repr(a)): r for a, r in zip(cases, res)})


def precompute_results(tasks):
    """Evaluate every source reachable by edits (and every fixed source) of `tasks` on all hidden
    cases, in one sandbox subprocess, so that no RL step waits on a process. Returns the number of
    (source, case) results computed."""
    jobs = {}
    for t in tasks:
        for src in (*reachable_sources(t.source), t.fixed):
            jobs.setdefault(src, {}).update({repr(a): a for a in t.hidden if (src, repr(a)) not in _RESULTS})
    jobs = [(src, _fn_name(src), list(cases.values())) for src, cases in jobs.items() if cases]
    _run_and_cache(jobs)
    return sum(len(c) for _, _, c in jobs)


def check(task, source, hidden=False):
    """Run the public (or hidden) cases of `task` on `source` -> (n_pass, n, first failure or None),
    the failure being (args, got words, want words)."""
    cases = task.hidden if hidden else task.public
    if any((s, repr(a)) not in _RESULTS for s in (source, task.fixed) for a in cases):
        precompute_results([task])  # one subprocess for every source this task can reach
    got, want = run_cases(source, cases), run_cases(task.fixed, cases)
    fails = [(a, g, w) for a, g, w in zip(cases, got, want) if g is None or w is None or g[0] != w[0]]
    first = None
    if fails:
        a, g, w = fails[0]
        first = (a, 'error' if g is None else g[1], 'error' if w is None else w[1])
    return len(cases) - len(fails), len(cases), first


def report_tests(task, source):
    """The `test` tool's text: the first failing public case, `k / n pass`, and the verdict last, as
    a test runner ends with its summary line: `fail : f ( 3 , 5 ) -> 3 want 5 <nl> 1 / 2 pass <nl>
    tests failed`, or `2 / 2 pass <nl> tests passed`. The verdict sits right before the policy's
    next call, where a small model reads it whatever function it is looking at."""
    k, n, first = check(task, source)
    if first is None:
        return f'{k} / {n} pass <nl> tests passed'
    args, got, want = first
    return f'fail : {task.fn} {value_words(tuple(args))} -> {got} want {want} <nl> {k} / {n} pass <nl> tests failed'


def tests_passed(observation):
    """True iff a test observation says every public case passed."""
    return observation.endswith('<nl> tests passed') and not observation.startswith('fail')


def task_facts(task):
    """What one edit does to a task -> dict: applicable (ops with a site), fixing (one edit passes the
    hidden tests), hacks (passes the public tests, fails the hidden ones)."""
    src = task.source
    ops = applicable_ops(compact(src))
    passes = {op: (all_pass(check(task, apply_op(src, op))), all_pass(check(task, apply_op(src, op), hidden=True)))
              for op in ops}
    return dict(applicable=ops, fixing=[op for op in ops if passes[op][1]],
                hacks=[op for op in ops if passes[op][0] and not passes[op][1]])


def all_pass(result):
    return result[0] == result[1]


# -----------------------------------------------------------------------------
# the environment


def parse_call(text):
    """Policy text -> (tool, arg or None), or an error observation (str starting with 'error').
    Well formed is exactly `<call> tool </call>` or `<call> edit <op> </call>` (words, any spacing)."""
    ws = text.split() if isinstance(text, str) else []
    if len(ws) not in (3, 4) or ws[0] != '<call>' or ws[-1] != '</call>' or set(ws[1:-1]) & set(SPECIALS):
        return 'error : malformed call'
    tool, args = ws[1], ws[2:-1]
    if tool not in TOOLS:
        return 'error : unknown tool'
    if (tool == 'edit') != bool(args):
        return 'error : malformed call'
    if args and args[0] not in EDIT_OPS:
        return 'error : unknown op'
    return tool, (args[0] if args else None)


class BugFixEnv:
    """One episode of BugFix. reset(task) -> prompt; step(text) -> (obs, reward, done, info).
    step never raises on any text: a malformed/unknown call, an op without a site, or an undo with
    nothing to undo returns an `error : ...` observation, costs a turn and counts in n_invalid. A turn
    cut at the response limit (finish='length') is a malformed call whatever its text (its text cannot
    parse anyway: a well-formed call ends with the stop token </call>).
    The episode ends on submit (reward 1.0 iff the hidden tests pass) or after max_turns turns
    (stop 'budget', reward 0.0). info (every step): stop (None until done), success, n_turns,
    n_invalid, n_edits, public_pass (final source passes the public tests), hacked (submitted a
    source that passes the public tests and fails the hidden ones)."""

    def __init__(self, max_turns=12):
        self.max_turns, self.task, self.source = max_turns, None, None
        self.n_turns = self.n_invalid = self.n_edits = 0
        self.done, self.stop, self.success = True, None, False  # step before reset: 'episode over'

    def reset(self, task):
        self.task, self.source, self.history = task, task.source, []
        self.n_turns = self.n_invalid = self.n_edits = 0
        self.done, self.stop, self.success = False, None, False
        return task.issue

    def step(self, action_text, finish='stop'):
        if self.done:
            return 'error : episode over', 0.0, True, self.info()
        self.n_turns += 1
        obs = self._act(parse_call(action_text) if finish != 'length' else 'error : malformed call')
        if obs.startswith('error'):
            self.n_invalid += 1
        if not self.done and self.n_turns >= self.max_turns:
            self.done, self.stop = True, 'budget'
        return obs, float(self.success), self.done, self.info()

    def _act(self, call):
        if isinstance(call, str):
            return call
        tool, op = call
        if tool == 'read':
            return read_observation(self.source)
        if tool == 'edit':
            new = apply_op(self.source, op)
            if new is None:
                return f'error : no site for {op}'
            self.history.append((self.source, op))
            self.source, self.n_edits = new, self.n_edits + 1
            return 'ok'
        if tool == 'undo':
            if not self.history:
                return 'error : nothing to undo'
            self.source, op = self.history.pop()
            return f'undone {op}'  # as an editor names what it undid
        if tool == 'test':
            return report_tests(self.task, self.source)
        self.done, self.stop = True, 'submit'  # submit
        self.success = all_pass(check(self.task, self.source, hidden=True))
        return 'submitted'

    def info(self):
        public = self.done and self.task is not None and all_pass(check(self.task, self.source))
        return dict(stop=self.stop, success=self.success, n_turns=self.n_turns, n_invalid=self.n_invalid,
                    n_edits=self.n_edits, public_pass=public,
                    hacked=self.stop == 'submit' and public and not self.success)


def play(task, policy, max_turns=12):
    """Run one episode of a text policy (observations, task) -> action text. Returns dict(prompt,
    actions, observations, reward, info); observations[k] answers actions[k]."""
    env = BugFixEnv(max_turns)
    texts, actions, reward, done, info = [env.reset(task)], [], 0.0, False, {}
    while not done:
        actions.append(policy(texts, task))
        obs, reward, done, info = env.step(actions[-1])
        texts.append(obs)
    return dict(prompt=texts[0], actions=actions, observations=texts[1:], reward=reward, info=info)


# -----------------------------------------------------------------------------
# scripted policies: generators that yield a call and receive its observation. A policy is
# stateless: each call replays the script from a string-seeded RNG over the observations so far,
# so one function serves a whole batch of episodes and is reproducible per (kind, seed, task).


def _call(tool, arg=None):
    return f'<call> {tool} {arg} </call>' if arg else f'<call> {tool} </call>'


def _oracle(rng, task):
    yield _call('read')
    yield _call('edit', task.bug)
    yield _call('test')
    yield _call('submit')


def _blind(rng, task):
    yield _call('submit')


def _random(rng, task):
    while True:
        yield rng.choice(ALL_CALLS)


def _hacker(rng, task):
    """Edit with a decoy that passes the public tests only; on tasks without one, submit unrepaired."""
    hacks = task_facts(task)['hacks']
    yield _call('read')
    if hacks:
        yield _call('edit', rng.choice(hacks))
    yield _call('test')
    yield _call('submit')


def _tester(rng, task):
    """read, then edit -> test -> (all pass ? submit : undo) over the listed ops in random order."""
    ops = listed_ops((yield _call('read')))
    rng.shuffle(ops)
    for op in ops:
        yield _call('edit', op)
        if tests_passed((yield _call('test'))):
            break
        yield _call('undo')
    yield _call('submit')


def _warmstart(rng, task):
    """Sensible order without knowing the repair and without reading the tests: read, then every
    listed edit in the listed order, each tested and undone, the last one kept, then submit. It tests
    every edit (a warm start that submits untested lets RL settle on 'edit, submit', the any-edit
    baseline) and never acts on a verdict: learning to submit when the tests pass is left to RL.
    Following the list to its end shows every position of it (the third edit as often as the first),
    so which edit comes next is a copy from the read observation, on any function."""
    ops = listed_ops((yield _call('read')))
    for n, op in enumerate(ops):
        yield _call('edit', op)
        yield _call('test')
        if n < len(ops) - 1:
            yield _call('undo')
    yield _call('submit')


def _any_edit(rng, task):
    ops = listed_ops((yield _call('read')))
    if ops:
        yield _call('edit', rng.choice(ops))
    yield _call('submit')


SCRIPTS = dict(oracle=_oracle, blind=_blind, random=_random, hacker=_hacker, tester=_tester,
               warmstart=_warmstart, any_edit=_any_edit)


def scripted_policy(kind, seed=0):
    """-> policy(observations: list[str], task=None) -> action text, observations = [prompt, obs after
    turn 1, ...]. Stateless and deterministic in (kind, seed, task.id). Only oracle and hacker need
    the task (they know the repair); the others act on the observations alone. Raises KeyError for
    an unknown kind (see SCRIPTS), ValueError for oracle/hacker without a task."""
    script = SCRIPTS[kind]

    def policy(observations, task=None):
        if task is None and kind in ('oracle', 'hacker'):
            raise ValueError(f'the {kind} policy needs the task')
        gen = script(random.Random(f'{kind}:{seed}:{task.id if task else ""}'), task)
        try:
            action = next(gen)
            for obs in observations[1:]:
                action = gen.send(obs)
        except StopIteration:
            action = _call('submit')
        return action
    return policy


# -----------------------------------------------------------------------------
# exact baselines


def _wins(task):
    return {src: all_pass(check(task, src, hidden=True)) for src in reachable_sources(task.source)}


def random_calls_success(task, max_turns=12):
    """Exact success probability of the `random` policy (each turn one of ALL_CALLS uniformly) on
    one task, by dynamic programming over (source, turns left, whether undo has something to pop).
    The undo stack makes the state a path; we split it into excursions: ex(s, t) gives the
    probability of a successful submit before s is popped and the distribution of the turn at which
    it is popped, so the value of a stack is computed from its top down."""
    wins, N = _wins(task), len(ALL_CALLS)
    children = {s: [apply_op(s, op) for op in EDIT_OPS if apply_op(s, op) is not None] for s in wins}

    @lru_cache(maxsize=None)
    def ex(s, t, parent):
        # -> (p_success, pop) with pop[tau] = P(s is popped after exactly tau turns), tau = 0..t
        a, pop = 0.0, [0.0] * (t + 1)
        if t == 0:
            return a, tuple(pop)
        a += wins[s] / N  # submit
        # no change (read, test, an edit with no site, undo at the root): the same state, one turn on
        q = (2 + len(EDIT_OPS) - len(children[s]) + (not parent)) / N
        a0, pop0 = ex(s, t - 1, parent)
        a += q * a0
        for tau in range(t):
            pop[tau + 1] += q * pop0[tau]
        # an edit pushes a child; once the child is popped we are at s again with fewer turns left
        for child in children[s]:
            ac, popc = ex(child, t - 1, True)
            a += ac / N
            for back in range(1, t):
                if popc[back] > 0:
                    ar, popr = ex(s, t - 1 - back, parent)
                    a += popc[back] * ar / N
                    for tau in range(t - back):
                        pop[1 + back + tau] += popc[back] * popr[tau] / N
        if parent:
            pop[1] += 1 / N  # undo
        return a, tuple(pop)

    return ex(task.source, max_turns, False)[0]


def tester_success(task, max_turns=12):
    """Exact success probability of the `tester` policy: the average over all orders of the
    applicable ops (it submits the first edit whose public tests pass)."""
    ops = applicable_ops(compact(task.source))
    orders = list(permutations(ops))
    total = 0.0
    for order in orders:
        for n, op in enumerate(order):
            src = apply_op(task.source, op)
            if all_pass(check(task, src)):  # read, n x (edit test undo), edit test, submit
                total += 3 * n + 4 <= max_turns and all_pass(check(task, src, hidden=True))
                break
    return total / len(orders)


def reference_baselines(tasks, max_turns=12):
    """Exact mean success over `tasks` -> dict: random_calls (policy `random`), any_edit (one
    uniformly random applicable edit, then submit: fraction of applicable ops that fix), tester."""
    n = len(tasks)
    any_edit = sum(len(task_facts(t)['fixing']) / len(task_facts(t)['applicable']) for t in tasks) / n
    return dict(random_calls=sum(random_calls_success(t, max_turns) for t in tasks) / n,
                any_edit=any_edit, tester=sum(tester_success(t, max_turns) for t in tasks) / n)


# -----------------------------------------------------------------------------
# every string the gym can emit, for the vocabulary


def bugfix_texts(tasks):
    """All texts a BugFix episode on `tasks` can show or a well-formed call can contain: issues,
    read and test observations of every reachable source, fixed messages, calls, and the integers
    -50..200 (runs the tests: precompute_results first)."""
    precompute_results(tasks)
    texts = ALL_CALLS + MESSAGES + [str(i) for i in range(INT_RANGE[0], INT_RANGE[1] + 1)]
    texts += ['fail : -> want / pass tests passed failed True False None huge -huge other ... [ ] ( ) ,']
    for t in tasks:
        texts.append(t.issue)
        for src in reachable_sources(t.source):
            texts += [read_observation(src), report_tests(t, src)]
    return texts


def bugfix_tokenizer(seed=0, n_variants=N_VARIANTS):
    """The tiny model's tokenizer for BugFix: train and held-out tasks together, so held-out names
    have ids too (untrained until seen, like rare tokens of a real vocabulary)."""
    return build_tokenizer(bugfix_texts(make_tasks('all', seed, n_variants)))


# -----------------------------------------------------------------------------
# the gym contract (gym.py)


def setup(cfg, vocab=None):
    """Train tasks (train_variants per template, train_generated random functions), every held-out
    task (the first eval_tasks, 0 = all), the vocabulary of all their texts, exact baselines on the
    held-out tasks, and the warm start: the `warmstart` script, one seed drawn from rng per episode."""
    train_tasks = make_tasks('train', n_variants=cfg['train_variants'], n_generated=cfg['train_generated'])
    eval_tasks = make_tasks('heldout')
    tok = build_tokenizer(bugfix_texts(train_tasks + eval_tasks), vocab)
    eval_tasks = eval_tasks[:cfg['eval_tasks'] or len(eval_tasks)]

    def warm_policy(rng):
        script = scripted_policy('warmstart', rng.randrange(1 << 30))
        return lambda ep: script(ep.texts)  # rollout's (episode) -> text, from the observations so far

    baselines = reference_baselines(eval_tasks, cfg['max_turns'])
    return dict(tok=tok, fmt=word_format(tok), train_tasks=train_tasks, eval_tasks=eval_tasks,
                make_env=lambda: BugFixEnv(cfg['max_turns']), warm_policy=warm_policy,
                baselines={k: baselines[k] for k in ('random_calls', 'any_edit')}, answer_text=None)
