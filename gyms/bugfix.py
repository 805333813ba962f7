"""
BugFix: the tiny model's world. Small Python functions with one injected bug, a handful of tools,
the words of every string the gym can show (the tiny model's vocabulary), and scripted policies.
The functions, the edits and running their tests are in gyms/bugfix_code.py.

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
- the reachable sources are few (every op is an involution, see bugfix_code), so the vocabulary,
  every test result and the baselines are computed exactly, ahead of training;
- a few templates have weak public tests: a decoy passes them and fails the hidden ones (the hacker).

Simplified on purpose:
1. The test observation shows only the first failing case (short observations for a tiny model).
"""

import random
from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations

from gym import SPECIALS, build_tokenizer, word_format
from gyms.bugfix_code import (ACCS, EDIT_OPS, FN_NAMES, HELDOUT, INT_RANGE, LISTS, LOOPS, SCALARS, TEMPLATES,
                              all_pass, applicable_ops, apply_op, check, compact, generated_templates,
                              involutive_ops, listed_ops, precompute_results, reachable_sources,
                              read_observation, renamed_forms, run_cases, value_words)

MODEL = 'tiny'
KEYS = ('train_variants', 'train_generated', 'val_tasks')
TASK_KEYS = ('train_variants', 'train_generated')  # validation excludes the training functions and needs their words;
# the checkpoint's vocabulary holds only theirs
TOOLS = ('read', 'edit', 'undo', 'test', 'submit')
ALL_CALLS = ([f'<call> {t} </call>' for t in ('read', 'undo', 'test', 'submit')]
             + [f'<call> edit {op} </call>' for op in EDIT_OPS])
MESSAGES = ['error : malformed call', 'error : unknown tool', 'error : unknown op', 'error : nothing to undo',
            'error : episode over', 'ok', 'submitted'] + [f'error : no site for {op}' for op in EDIT_OPS] + [
            f'undone {op}' for op in EDIT_OPS]


# -----------------------------------------------------------------------------
# tasks: a template's variant with one injected bug (bugfix_code has the templates and the edits)

N_VARIANTS = 6
GEN_VARIANTS = 4  # variants per generated training function (see generated_templates)
# the validation split (setup's val_tasks): 32 functions of the grammar, one variant each, that training and
# held-out never see. Recipes are chosen on it, never on held-out; 32 tasks add about two thirds of the
# 48 held-out tasks' episodes to an evaluation. A constant, not a config key: one split for every run.
VAL_FUNCTIONS = 32
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


def bug_ops(tpl, seed, variant, target=()):
    """Ops that make a real bug in this variant: they have a site in the wanted source, undo
    themselves, and break at least one public case (so `test` can show it) -> list[str]. The
    template's own bug comes first. Runs the cases in the sandbox (cached)."""
    fixed = make_task(tpl, seed, variant, target=target).fixed
    want = run_cases(fixed, tpl.public)
    broken = [op for op in involutive_ops(fixed) if run_cases(apply_op(fixed, op), tpl.public) != want]
    return sorted(broken, key=lambda op: op != tpl.bug)


def _targets(tpl, seed, variant, tries=8):
    """Random wanted functions for one training variant: each of the template's ops applied or not
    with probability 1/2 (`min` or `max`, `<` or `<=`, ...), `tries` draws from a string-seeded RNG,
    then the template itself as a last resort -> list of op tuples."""
    rng = random.Random(f'bugfix-target:{seed}:{tpl.name}:{variant}')
    ops = involutive_ops(make_task(tpl, seed, variant).fixed)
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


def make_tasks(split, seed=0, n_variants=N_VARIANTS, n_generated=0, exclude=()):
    """split 'train' | 'heldout' | 'val' | 'all' (train + heldout) -> list[Task], n_variants per
    template, deterministic in seed. Held-out templates (HELDOUT) never appear in 'train'. Raises
    ValueError on an unknown split.

    'val', the validation split: n_generated functions of the grammar from their own seed stream
    (`val:{seed}`, named val0, val1, ...; training's are gen0, ... of stream `seed`), none of which is,
    in any edited form and up to renaming, a held-out function or the function of a task in `exclude`
    (pass the training tasks); min(n_variants, GEN_VARIANTS) variants each, made as held-out tasks
    are (the function itself is wanted, natural bugs, decoys that pass the public tests kept).

    Held-out tasks are the natural bugs: the template is the wanted function and each variant breaks
    it with one of its bug_ops. Training tasks must not be solvable by memory: with 22 templates a
    policy learns each template's correct form and repairs whatever differs from it, which does not
    transfer to a function it has never seen. So a training variant wants a random sibling of its
    template (`_targets`), and the injected op is balanced per template and overall; the source
    alone then does not say which edit repairs it, only the tests do. Training variants are also
    drawn without decoys that pass the public tests (hacks): there the tests could not tell, and the
    train success would be capped below 1 by luck; held-out tasks keep theirs."""
    if split not in ('train', 'heldout', 'val', 'all'):
        raise ValueError(f'unknown split {split!r}')
    if split == 'all':
        return make_tasks('train', seed, n_variants, n_generated) + make_tasks('heldout', seed, n_variants)
    train = split == 'train'
    if split == 'val':
        tpls = generated = generated_templates(n_generated, f'val:{seed}', 'val', renamed_forms(t.source for t in exclude))
    else:
        generated = generated_templates(n_generated, seed) if train else []
        tpls = [t for t in TEMPLATES if (t.name in HELDOUT) != train] + generated
    n_var = {t.name: min(n_variants, GEN_VARIANTS) if t in generated else n_variants for t in tpls}
    targets = {(t.name, v): _targets(t, seed, v) if train else [()] for t in tpls for v in range(n_var[t.name])}
    drafts = [make_task(t, seed, v, op, target) for t in tpls for v in range(n_var[t.name])
              for target in targets[t.name, v] for op in involutive_ops(make_task(t, seed, v, target=target).fixed)]
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
# the test tool's observation, and what one edit does to a task


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
    held-out tasks, and the warm start: the `warmstart` script, one seed drawn from rng per episode.
    With val_tasks > 0 also the validation split (gym.py's contract does not require it; train.py's
    evaluate logs eval_val_*): make_tasks('val') of VAL_FUNCTIONS functions none of these training
    tasks has, the first val_tasks (and eval_tasks) of them. Its texts do not join the vocabulary, so
    that adding the split changes no id and no number of a run: a task with a word outside it is
    dropped (none of config/tiny.yaml's 32 is, nor with train_generated 0)."""
    train_tasks = make_tasks('train', n_variants=cfg['train_variants'], n_generated=cfg['train_generated'])
    eval_tasks = make_tasks('heldout')
    tok = build_tokenizer(bugfix_texts(train_tasks + eval_tasks), vocab)
    eval_tasks = eval_tasks[:cfg['eval_tasks'] or len(eval_tasks)]
    val_tasks = [t for t in make_tasks('val', n_variants=1, n_generated=VAL_FUNCTIONS, exclude=train_tasks)
                 if all(w in tok.stoi for text in bugfix_texts([t]) for w in text.replace('\n', ' <nl> ').split())
                 ] if cfg['val_tasks'] else []  # building it takes seconds: only when asked for
    val_tasks = val_tasks[:min(cfg['eval_tasks'] or len(val_tasks), cfg['val_tasks'])]

    def warm_policy(rng):
        script = scripted_policy('warmstart', rng.randrange(1 << 30))
        return lambda ep: script(ep.texts)  # rollout's (episode) -> text, from the observations so far

    baselines = reference_baselines(eval_tasks, cfg['max_turns'])
    return dict(tok=tok, fmt=word_format(tok), train_tasks=train_tasks, eval_tasks=eval_tasks, val_tasks=val_tasks,
                make_env=lambda: BugFixEnv(cfg['max_turns']), warm_policy=warm_policy,
                baselines=baselines, answer_text=None)
