"""
The Python side of BugFix: small functions, the edits that break and repair them, and running their
tests. gyms/bugfix.py builds tasks, tools and episodes on top of it.

    EDIT_OPS      the named repairs; each toggles the first site of a token class
    TEMPLATES     22 hand-written correct functions (HELDOUT: those never trained on)
    generated_templates   random training functions from a grammar of the same kinds of lines
    run_cases, check      a function's results on argument tuples, run in the sandbox and cached

Why the edits look like this:
- every op is an involution on a token class (min<->max, < <-> >, 0 <-> 1 ...), so the set of sources
  an episode can reach is small and closed: we enumerate it to build the vocabulary, to precompute
  every test result in one subprocess, and to compute baselines exactly;
- the ops applicable to a source are visible in its tokens (`min`/`max` => swap_minmax, `range` =>
  fix_range_end, `<`/`>`... => flip_compare and fix_strict, ...).

Simplified on purpose:
1. Test code runs only in a sandbox subprocess (sandbox.run_python); results are cached per
   (source, case) and can be precomputed for all reachable sources in one subprocess.
2. Integers outside -50..200 are shown as `huge` / `-huge`, lists longer than 6 are cut with `...`:
   the vocabulary stays closed and small.
"""

import inspect
import json
import random
from dataclasses import dataclass
from functools import lru_cache

from gyms import sandbox

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

def compact(source):
    """Python source -> the read observation: tokens joined by single spaces, lines by ` <nl> `."""
    return ' <nl> '.join(' '.join(line.split()) for line in source.split('\n'))


@lru_cache(maxsize=1 << 20)  # task generation applies the same (source, op) pairs again and again
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


def involutive_ops(fixed):
    """Ops with a site in source `fixed` whose edit the same op undoes -> list[str], EDIT_OPS order."""
    return [op for op in EDIT_OPS if (src := apply_op(fixed, op)) is not None and apply_op(src, op) == fixed]


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

# the names a variant draws from (bugfix.make_task); _renamed forgets them
FN_NAMES = ['f', 'g', 'h', 'fn', 'calc', 'solve', 'work', 'run', 'go', 'get', 'step', 'check']
SCALARS = ['a', 'b', 'c', 'x', 'y', 'z', 'p', 'q', 'u', 'v', 'w', 'm', 'n']
LISTS = ['xs', 'ys', 'zs', 'vs', 'ws', 'ls', 'arr', 'nums']
LOOPS = ['i', 'j', 'k', 'e', 'd', 't']
ACCS = ['s', 'r', 'acc', 'res', 'out', 'tot', 'best', 'cnt']


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

    def expr(pool):  # a plain name as often as the four forms that add an edit site together
        x, y = rng.choice(pool), rng.choice(pool + [const()])
        return rng.choice([x] * 4 + [f'{x} + {y}', f'{x} - {y}', f'max ( {x} , {y} )', f'min ( {x} , {y} )'])

    def compare(pool):
        x = rng.choice(pool)
        return f'{x} {cmp()} {rng.choice([y for y in atoms if y != x] + [const()])}'

    def cond(pool):
        c = compare(pool)
        return c if rng.random() < 0.6 else f'{c} {rng.choice(["and", "or"])} {compare(pool)}'

    shape = rng.choice(['guard', 'range', 'range', 'list', 'list', 'bool', 'comp'] if lst else ['guard', 'range', 'range', 'bool'])
    if shape == 'guard':
        lines = [f'if {cond(atoms)} : return {expr(atoms)}', f'return {expr(atoms)}']
    elif shape == 'bool':
        lines = [f'return {cond(atoms)}']
    elif shape == 'range':
        end = rng.choice([f'{rng.choice(atoms)}', f'{rng.choice(atoms)} + 1'])
        start = rng.choice(['', '', f'{const()} , '])
        body = rng.choice(['{s} += {i}', '{s} = {s} + {i}', '{s} -= {i}', '{s} = max ( {s} , {i} )',
                           f'{{s}} = {{s}} + {rng.choice(atoms)}', 'if {i} % 2 == 0 : {s} += 1',
                           f'if {compare(["{i}"])} : {{s}} = {{i}}', f'if {compare(["{i}"])} : {{s}} += 1'])
        init = rng.choice(['0', '1', scal[0]] + (['{xs} [ 0 ]', '{xs} [ -1 ]'] if lst else []))
        loop = f'for {{i}} in range ( {start}{end} ) :'  # an if goes on a line of its own
        loop = f'{loop}\n    {body}' if body.startswith('if') else f'{loop} {body}'
        lines = [f'{{s}} = {init}', loop, f'return {expr(["{s}"] + atoms[:1])}']
    elif shape == 'list':
        init = rng.choice(['{s} = 0', '{s} = 1', '{s} = {xs} [ 0 ]', '{s} = {xs} [ -1 ]', '{s} = {a}'])
        pool = ['{e}', '{s}'] + scal
        body = rng.choice([f'if {cond(["{e}"])} : {{s}} = {expr(pool)}', f'{{s}} = {expr(pool)}',
                           f'if {cond(["{e}"])} : {{s}} += 1', '{s} += {e}', '{s} -= {e}',
                           f'if {compare(["{e}"])} : {{s}} = {{e}}'])
        nested = body.startswith('if')  # `for ... : if ... :` on one line is a syntax error
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


def renamed_forms(sources):
    """Every source reachable by edits from any of `sources`, up to renaming (see _renamed) -> set[str]."""
    return {_renamed(x) for src in sources for x in reachable_sources(src)}


@lru_cache(maxsize=None)
def _heldout_forms():
    """Every held-out function and its edited forms, up to renaming (see _renamed) -> set[str]."""
    return frozenset(renamed_forms(t.code.format(**CANONICAL_NAMES) for t in TEMPLATES if t.name in HELDOUT))


GEN_DRAWS_MIN, GEN_DRAWS_PER_FUNCTION = 10_000, 60  # grammar draws per call to _edit_list_pool


def _edit_list_pool(rng, n, avoid):
    """Draw max(GEN_DRAWS_MIN, GEN_DRAWS_PER_FUNCTION * n) functions from the grammar; keep those with exactly 3
    edits that undo themselves, at most 40 words in every edited form, and no form in `avoid` or in an
    earlier draw, up to renaming -> {edit list (tuple): [(code, source, ops, cases)] in draw order}."""
    pool = {}
    for _ in range(max(GEN_DRAWS_MIN, GEN_DRAWS_PER_FUNCTION * n)):
        code, lst, n_scal = _gen_code(rng)
        src = code.format(**CANONICAL_NAMES)
        ops = involutive_ops(src)
        if len(ops) != 3:
            continue
        forms = reachable_sources(src)
        renamed = {_renamed(x) for x in forms}
        if all(len(read_observation(x).split()) <= 40 for x in forms) and not renamed & avoid:
            avoid |= renamed
            pool.setdefault(tuple(ops), []).append((code, src, ops, _gen_args(rng, lst, n_scal, 6)))
    return pool


def generated_templates(n, seed=0, prefix='gen', exclude=frozenset()):
    """n random functions (Template, names gen0, gen1, ... or prefix0, ...), deterministic in seed: one
    seed, one stream (training draws seed 0, the validation split its own, see bugfix.make_tasks). Each
    one runs without error on its 6 cases, has 3 edits that undo themselves (as most held-out functions
    do; the templates already have many 2-edit ones), at least one of which breaks a public case,
    reads in at most 40 words in every edited form (as the templates do), and is none of the held-out
    functions' forms, nor of `exclude`, nor another's (renamed_forms), up to renaming.

    Balanced over edit lists: the grammar makes some lists (`flip_compare fix_strict fix_logic`) 25
    times as often as others (`flip_compare fix_strict fix_init`), and a policy trained on the raw draws
    learnt which third edit follows the first two as a prior over the lists it had seen, so it failed
    on a held-out function whose list training never showed. Functions are therefore taken in turn
    from each list (sorted), gen0 from the first list, gen1 from the second, ...: every list the grammar
    can make is about equally common. Candidates run in batches, one sandbox process per batch."""
    if n == 0:  # train_generated 0, the default: no draws at all
        return []
    rng = random.Random(f'bugfix-gen:{seed}')
    pool = _edit_list_pool(rng, n, set(_heldout_forms()) | set(exclude))
    lists = sorted(pool)
    order = [pool[k][j] for j in range(max(map(len, pool.values()))) for k in lists if j < len(pool[k])]
    out = []
    while len(out) < n and order:
        batch, order = order[:2 * (n - len(out))], order[2 * (n - len(out)):]
        _run_and_cache([(x, 'f', cases) for _, src, ops, cases in batch for x in [src] + [apply_op(src, op) for op in ops]])
        for code, src, ops, cases in batch:
            want = run_cases(src, cases)
            if len(out) == n or any(r is None for r in want) or len({r[0] for r in want}) < 2:
                continue
            broken = [op for op in ops if run_cases(apply_op(src, op), cases[:2]) != want[:2]]
            if broken:
                out.append(Template(f'{prefix}{len(out)}', code, broken[0], tuple(cases[:2]), tuple(cases[2:])))
    if len(out) < n:
        raise ValueError(f'the grammar gave {len(out)} valid functions of {n} asked for (raise GEN_DRAWS_PER_FUNCTION)')
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
        cases = [(repr(a), a) for a in t.hidden]
        for src in (*reachable_sources(t.source), t.fixed):
            jobs.setdefault(src, {}).update({r: a for r, a in cases if (src, r) not in _RESULTS})
    jobs = [(src, _fn_name(src), list(cases.values())) for src, cases in jobs.items() if cases]
    _run_and_cache(jobs)
    return sum(len(c) for _, _, c in jobs)


def check(task, source, hidden=False):
    """Run the public (or hidden) cases of `task` (a bugfix.Task: its fixed source gives the wanted
    results) on `source` -> (n_pass, n, first failure or None), the failure being (args, got words,
    want words)."""
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


def all_pass(result):
    """True iff a check result (n_pass, n, first failure) says every case passed."""
    return result[0] == result[1]
