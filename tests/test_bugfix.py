import random
import statistics

import pytest
from hypothesis import given, settings, strategies as st

import gym
from gyms import bugfix, bugfix_code as code, sandbox

TRAIN, HELDOUT = bugfix.make_tasks('train'), bugfix.make_tasks('heldout')
ALL = TRAIN + HELDOUT
code.precompute_results(ALL)
TOK = bugfix.bugfix_tokenizer()


def episodes(kind, tasks, seeds):
    return [bugfix.play(t, bugfix.scripted_policy(kind, s)) for t in tasks for s in seeds]


# -----------------------------------------------------------------------------
# tokenizer


def test_specials_have_fixed_ids_and_round_trip():
    assert TOK.itos[:16] == gym.SPECIALS
    assert (TOK.pad_id, TOK.bos_id, TOK.unk_id, TOK.obs_id, TOK.obs_end_id, TOK.call_id, TOK.call_end_id) == tuple(range(7))
    text = code.compact(ALL[0].source)
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.encode('<call> edit swap_minmax </call>')[0] == 5
    with pytest.raises(ValueError, match="word 'banana' is not in the tiny vocabulary"):
        TOK.encode('read banana')  # a closed vocabulary: an unknown word is a bug in the gym's texts
    assert TOK.vocab_size < 500


@pytest.mark.parametrize('kind', sorted(bugfix.SCRIPTS))
def test_no_unk_in_any_observation_or_call(kind):
    seeds = range(3) if kind in ('random', 'warmstart', 'tester', 'any_edit') else [0]
    for ep in episodes(kind, ALL, seeds):
        for text in [ep['prompt']] + ep['actions'] + ep['observations']:
            assert TOK.unk_id not in TOK.encode(text), text


def test_observations_are_short():
    for t in ALL:
        for src in code.reachable_sources(t.source):
            assert len(code.read_observation(src).split()) <= 40
            assert len(bugfix.report_tests(t, src).split()) <= 33


# -----------------------------------------------------------------------------
# tasks and edits


def test_heldout_functions_never_in_train():
    train_names = {t.template for t in TRAIN}
    assert train_names.isdisjoint({t.template for t in HELDOUT}) and len({t.template for t in HELDOUT}) >= 6
    codes = {tpl.code for tpl in code.TEMPLATES if tpl.name in train_names}
    assert not any(tpl.code in codes for tpl in code.TEMPLATES if tpl.name in code.HELDOUT)


GENERATED = code.generated_templates(30)


def test_generated_functions_are_valid_and_never_heldout():
    assert code.generated_templates(30) == GENERATED and code.generated_templates(30, seed=1) != GENERATED
    assert len({tpl.code for tpl in GENERATED}) == 30 and [t.name for t in GENERATED] == [f'gen{k}' for k in range(30)]
    held = code._heldout_forms()
    assert len(held) >= 8 * 4  # every held-out function and its edited forms
    for tpl in GENERATED:
        task = bugfix.make_task(tpl, 0, 0)
        assert task.source != task.fixed and len(task.hidden) == 6
        assert len(code.involutive_ops(task.fixed)) == 3
        assert not {code._renamed(x) for x in code.reachable_sources(task.fixed)} & held
        assert all(r is not None for r in code.run_cases(task.fixed, task.hidden))     # runs on every case
        assert not code.all_pass(code.check(task, task.source))                        # the bug shows in `test`
        assert all(len(code.read_observation(x).split()) <= 40 for x in code.reachable_sources(task.source))
    # the check above can fail: a held-out function's code is one of the forms it rejects
    clamp = next(t for t in HELDOUT if t.template == 'clamp')  # variant names, not the canonical ones
    assert code._renamed(clamp.source) in held and code._renamed(clamp.fixed) in held


def test_generated_functions_are_balanced_over_edit_lists():
    # the raw grammar makes `flip_compare fix_strict fix_logic` many times as often as `... fix_init`;
    # taken in turn from each list, no list is much more common than another
    rng = random.Random(0)
    pool = code._edit_list_pool(rng, 0, set(code._heldout_forms()))
    sizes = sorted(map(len, pool.values()))
    assert len(pool) >= 10 and sizes[-1] >= 10 * sizes[0]
    lists = [tuple(code.involutive_ops(t.code.format(**code.CANONICAL_NAMES))) for t in GENERATED]
    assert all(k in pool for k in lists) and len(set(lists)) >= 10
    assert max(lists.count(k) for k in set(lists)) <= 5  # 30 functions: a raw draw gives one list about 12
    assert ('flip_compare', 'fix_strict', 'fix_init') in lists  # floor_max's list, which training once never showed


def test_generated_functions_join_training_only():
    train = bugfix.make_tasks('train', n_variants=2, n_generated=30)
    gen = [t for t in train if t.template.startswith('gen')]
    assert len(gen) == 30 * min(2, bugfix.GEN_VARIANTS) and len(train) == len(gen) + len(code.TEMPLATES) * 2 - 2 * len(code.HELDOUT)
    assert {t.template for t in gen} == {tpl.name for tpl in GENERATED}
    assert all(code.all_pass(code.check(t, code.apply_op(t.source, t.bug), hidden=True)) for t in gen)
    assert bugfix.make_tasks('heldout', n_variants=2) == bugfix.make_tasks('heldout', n_variants=2)
    assert not any(t.template.startswith('gen') for t in bugfix.make_tasks('all', n_variants=1))
    # the tokenizer bugfix.setup builds covers every text of the scripted policies on them: no <unk>
    tok = gym.build_tokenizer(bugfix.bugfix_texts(train + HELDOUT))
    for kind in ('warmstart', 'tester', 'random', 'hacker', 'oracle'):
        for ep in episodes(kind, gen[:20], [0, 1]):
            assert all(tok.unk_id not in tok.encode(x) for x in [ep['prompt']] + ep['actions'] + ep['observations'])


def test_validation_split_is_neither_training_nor_heldout():
    train = bugfix.make_tasks('train', n_variants=2, n_generated=30)
    val = bugfix.make_tasks('val', n_variants=1, n_generated=bugfix.VAL_FUNCTIONS, exclude=train)
    assert val == bugfix.make_tasks('val', n_variants=1, n_generated=bugfix.VAL_FUNCTIONS, exclude=train)
    assert [t.template for t in val] == [f'val{k}' for k in range(bugfix.VAL_FUNCTIONS)]
    assert len({code.compact(t.fixed) for t in val}) == bugfix.VAL_FUNCTIONS
    seen = code.renamed_forms(t.source for t in train + HELDOUT)  # no function, in any edited form, renamed or not
    assert all(not code.renamed_forms([t.source]) & seen for t in val)
    for t in val:  # natural bugs, as held-out: the function itself is wanted, the bug shows in `test`, its op repairs it
        assert len(t.hidden) == 6 and not code.all_pass(code.check(t, t.source))
        assert code.all_pass(code.check(t, code.apply_op(t.source, t.bug), hidden=True))
    assert len({t.bug for t in val}) >= 5  # balanced over the ops, as held-out
    # its own seed stream: the training functions are the ones they were, and exclude is honoured
    assert code.generated_templates(30) == GENERATED
    again = bugfix.make_tasks('val', n_variants=1, n_generated=4, exclude=val[:2])
    assert not code.renamed_forms(t.source for t in again) & code.renamed_forms(t.source for t in val[:2])


def test_setup_returns_the_validation_split_without_changing_the_vocabulary():
    from config import load_config
    cfg = load_config(['--gym=bugfix', '--train_variants=2', '--train_generated=10', '--eval_tasks=0', '--val_tasks=32',
                       '--out_dir=unused'])
    g = gym.load_gym(cfg)
    assert 'val_tasks' not in gym.SETUP_KEYS  # optional: a gym without one keeps the contract
    words = gym.build_tokenizer(bugfix.bugfix_texts(g['train_tasks'] + bugfix.make_tasks('heldout'))).itos
    assert g['tok'].itos == words  # the split adds no word: every id, so every number of a run, stays
    assert len(g['val_tasks']) >= bugfix.VAL_FUNCTIONS - 4 and all(t.template.startswith('val') for t in g['val_tasks'])
    for ep in episodes('tester', g['val_tasks'], [0]):  # every text it shows is in the vocabulary
        assert all(g['tok'].unk_id not in g['tok'].encode(x) for x in [ep['prompt']] + ep['actions'] + ep['observations'])
    assert len(gym.load_gym(dict(cfg, eval_tasks=3))['val_tasks']) == 3  # eval_tasks caps it as it caps held-out
    assert len(gym.load_gym(dict(cfg, val_tasks=5))['val_tasks']) == 5 and gym.load_gym(dict(cfg, val_tasks=0))['val_tasks'] == []


def test_tasks_deterministic_and_varied():
    assert bugfix.make_tasks('train') == TRAIN and bugfix.make_tasks('train', seed=1) != TRAIN
    for name in {t.template for t in ALL}:
        assert len({t.source for t in ALL if t.template == name}) >= 3  # names vary across variants
    with pytest.raises(ValueError):
        bugfix.make_tasks('test')


def test_training_sources_do_not_tell_the_repair():
    """A policy that has memorised each training template's correct form and repairs whatever
    differs from it solves every held-out-style (natural) task; on training tasks it must be no better
    than a coin, or RL learns that instead of reading the tests (what the prototype did)."""
    def canonical(t):
        tpl = next(x for x in code.TEMPLATES if x.name == t.template)
        return bugfix.make_task(tpl, 0, int(t.id.split('/')[-1])).fixed

    def memoriser_success(tasks):
        wins = 0
        for t in tasks:
            op = next((op for op in code.EDIT_OPS if code.apply_op(t.source, op) == canonical(t)), None)
            wins += op is not None and code.all_pass(code.check(t, code.apply_op(t.source, op), hidden=True))
        return wins / len(tasks)
    assert memoriser_success(HELDOUT) == 1.0
    assert memoriser_success(TRAIN) <= 0.5
    for t in TRAIN:  # the wanted sibling is a working function: no case raises
        assert all(r is not None for r in code.run_cases(t.fixed, t.hidden))
    wants_template = sum(t.fixed == canonical(t) for t in TRAIN) / len(TRAIN)  # the rest want a sibling
    assert 0.05 <= wants_template <= 0.5
    # and the tests still decide: a test-driven policy can reach >= 0.95 on the training tasks
    assert bugfix.reference_baselines(TRAIN)['tester'] >= 0.95


def test_read_lists_the_applicable_edits_in_one_fixed_order():
    for t in ALL:
        env = bugfix.BugFixEnv()
        env.reset(t)
        obs = env.step('<call> read </call>')[0]
        listed = code.listed_ops(obs)
        assert listed == code.applicable_ops(code.compact(t.source)) and len(listed) >= 2
        assert listed == [op for op in code.EDIT_OPS if code.apply_op(env.source, op) is not None]  # EDIT_OPS order
        assert env.step('<call> read </call>')[0] == obs
    for ep in episodes('warmstart', ALL, [0]):  # the warm start copies the whole list, in its order
        edits = [a.split()[2] for a in ep['actions'] if a.split()[1] == 'edit']
        assert edits == code.listed_ops(ep['observations'][0])
        assert [a.split()[1] for a in ep['actions']].count('test') == len(edits)  # every edit tested
    assert code.listed_ops('ok') == []


def test_edits_deterministic_involutions_and_bug_op_repairs():
    kinds = {t.bug for t in ALL}
    assert len(kinds) >= 6
    for t in ALL:
        assert code.apply_op(t.source, t.bug) == t.fixed
        for op in code.EDIT_OPS:
            new = code.apply_op(t.source, op)
            assert new == code.apply_op(t.source, op)
            assert new is None or code.apply_op(new, op) == t.source
        assert 2 <= len(code.applicable_ops(code.compact(t.source))) <= 3  # decoys, and tester fits the budget


def test_hand_written_ops():
    src = 'def f ( a ) :\n    s = 0\n    for i in range ( a ) : s += i\n    return s'
    assert code.apply_op(src, 'fix_range_end') == 'def f ( a ) :\n    s = 0\n    for i in range ( a + 1 ) : s += i\n    return s'
    assert code.apply_op(src, 'fix_init').split('\n')[1] == '    s = 1'
    assert code.apply_op(src, 'fix_operator').split('\n')[2] == '    for i in range ( a ) : s -= i'
    assert code.apply_op(src, 'swap_minmax') is None
    # the `+ 1` of a range end is not an operator site
    assert code.apply_op('def f ( a ) :\n    return range ( a + 1 )', 'fix_operator') is None


# -----------------------------------------------------------------------------
# environment


def test_oracle_solves_every_task_and_blind_never():
    assert all(ep['reward'] == 1.0 and ep['info']['stop'] == 'submit' for ep in episodes('oracle', ALL, [0]))
    assert all(ep['reward'] == 0.0 for ep in episodes('blind', ALL, [0]))


def test_buggy_source_fails_public_tests():
    for t in ALL:
        k, n, first = code.check(t, t.source)
        assert k < n and first is not None


def test_hacker_passes_public_and_gets_zero():
    hack_tasks = [t for t in ALL if bugfix.task_facts(t)['hacks']]
    assert hack_tasks and any(t in HELDOUT for t in hack_tasks)
    for ep in episodes('hacker', hack_tasks, [0]):
        assert ep['observations'][2].endswith('tests passed') and bugfix.tests_passed(ep['observations'][2])
        assert ep['reward'] == 0.0 and ep['info']['public_pass'] and ep['info']['hacked']


def test_tester_reaches_ninety_percent_on_heldout():
    eps = episodes('tester', HELDOUT, range(3))
    assert statistics.mean(ep['reward'] for ep in eps) >= 0.9
    assert max(ep['info']['n_turns'] for ep in eps) <= 12


def test_invalid_calls_cost_a_turn_and_episode_continues():
    env = bugfix.BugFixEnv(max_turns=12)
    env.reset(HELDOUT[0])
    absent = next(op for op in code.EDIT_OPS if op not in code.applicable_ops(code.compact(HELDOUT[0].source)))
    cases = [('read the code', 'error : malformed call'), ('<call> run </call>', 'error : unknown tool'),
             ('<call> edit banana </call>', 'error : unknown op'), ('<call> edit </call>', 'error : malformed call'),
             ('<call> read now </call>', 'error : malformed call'), ('<call> undo </call>', 'error : nothing to undo'),
             (f'<call> edit {absent} </call>', f'error : no site for {absent}')]
    for n, (text, want) in enumerate(cases, 1):
        obs, reward, done, info = env.step(text)
        assert (obs, reward, done, info['n_turns'], info['n_invalid']) == (want, 0.0, False, n, n)
    obs, _, done, info = env.step('<call>   read </call>')
    assert obs == code.read_observation(HELDOUT[0].source) and not done and info['n_invalid'] == len(cases)


def test_edit_test_undo_cycle():
    t = HELDOUT[0]
    env = bugfix.BugFixEnv()
    env.reset(t)
    assert env.step(f'<call> edit {t.bug} </call>')[0] == 'ok'
    obs = env.step('<call> test </call>')[0]
    assert obs == '2 / 2 pass <nl> tests passed' and bugfix.tests_passed(obs)
    assert env.step('<call> undo </call>')[0] == f'undone {t.bug}' and env.source == t.source
    obs = env.step('<call> test </call>')[0]
    assert obs.startswith(f'fail : {t.fn} (') and obs.endswith('pass <nl> tests failed') and not bugfix.tests_passed(obs)
    assert env.step('<call> submit </call>')[1:3] == (0.0, True)
    assert env.step('<call> read </call>')[0] == 'error : episode over'


def test_budget_ends_episode_with_zero_reward():
    env = bugfix.BugFixEnv(max_turns=3)
    env.reset(HELDOUT[0])
    results = [env.step('<call> read </call>') for _ in range(3)]
    assert [r[2] for r in results] == [False, False, True]
    assert results[-1][1] == 0.0 and results[-1][3]['stop'] == 'budget'


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=40), st.lists(st.sampled_from(
    ['<call>', '</call>', 'edit', 'read', 'undo', 'test', 'submit', 'fix_init', 'fix_index', '<nl>', 'x', '\n']),
    max_size=6).map(' '.join)), min_size=1, max_size=14))
def test_step_never_raises_on_arbitrary_text(texts):
    env = bugfix.BugFixEnv()
    env.reset(HELDOUT[3])
    for text in texts:
        obs, reward, done, info = env.step(text)
        assert isinstance(obs, str) and reward in (0.0, 1.0) and isinstance(info, dict)
    assert env.step(None)[0] in ('error : malformed call', 'error : episode over')


# -----------------------------------------------------------------------------
# running tests: sandboxed, cached, robust to loops and exceptions


def test_results_are_cached(monkeypatch):
    task = bugfix.make_tasks('heldout', seed=7, n_variants=1)[0]  # runs the candidate bugs' cases itself
    calls = []
    real = sandbox.run_python
    monkeypatch.setattr(sandbox, 'run_python', lambda *a, **k: calls.append(1) or real(*a, **k))
    code.precompute_results([task])  # what make_tasks did not run yet: at most one process
    assert len(calls) <= 1
    n = len(calls)
    assert code.precompute_results([task]) == 0
    env = bugfix.BugFixEnv()
    env.reset(task)
    for op in code.EDIT_OPS:
        env.step(f'<call> edit {op} </call>')
        env.step('<call> test </call>')
    assert len(calls) == n


def test_infinite_loop_and_exception_are_errors_not_hangs():
    src = 'def f ( a ) :\n    while a > 0 : a = a + 1\n    return 1 // a'
    assert code.run_cases(src, ((1,), (0,), (-1,))) == [None, None, ('-1', '-1')]  # endless loop, ZeroDivisionError
    assert code.value_words([1, 2, 3, 4, 5, 6, 7, 900]) == '[ 1 , 2 , 3 , 4 , 5 , 6 , ... ]'
    assert code.value_words((-7000, True, None, 'x', [])) == '( -huge , True , None , other , [ ] )'


# -----------------------------------------------------------------------------
# baselines: exact values against Monte Carlo


def test_reference_baselines_match_monte_carlo():
    exact = bugfix.reference_baselines(HELDOUT)
    assert 0.3 <= exact['any_edit'] <= 0.45 and exact['tester'] >= 0.9 and exact['random_calls'] < 0.15
    for kind, key, n, tol in [('random', 'random_calls', 60, 0.03), ('any_edit', 'any_edit', 60, 0.05),
                              ('tester', 'tester', 30, 0.05)]:
        mc = statistics.mean(ep['reward'] for ep in episodes(kind, HELDOUT, range(n)))
        assert abs(mc - exact[key]) < tol, (kind, mc, exact[key])


def test_random_calls_dp_on_a_hand_computable_budget():
    # one turn: only `submit` can end it, and the buggy source fails -> 0; two turns: edit the right
    # op (1/12) then submit (1/12)
    t = HELDOUT[0]
    assert bugfix.random_calls_success(t, 1) == 0.0
    assert bugfix.random_calls_success(t, 2) == pytest.approx(len(bugfix.task_facts(t)['fixing']) / 144)


def test_policies_without_task_act_on_observations_alone():
    # train.py hands scripted policies only the observations (episode.texts)
    for kind in ('tester', 'warmstart', 'random', 'any_edit', 'blind'):
        pol = bugfix.scripted_policy(kind, seed=3)
        eps = [bugfix.play(t, lambda obs, task: pol(obs)) for t in HELDOUT]
        assert all(ep['info']['stop'] in ('submit', 'budget') for ep in eps)
    assert statistics.mean(bugfix.play(t, lambda obs, task: bugfix.scripted_policy('tester', 1)(obs))['reward']
                           for t in HELDOUT) >= 0.85
    with pytest.raises(ValueError):
        bugfix.scripted_policy('oracle')(['issue : f is broken'])


# -----------------------------------------------------------------------------
# turns cut at max_response_tokens (rollout's finish='length')


def test_cut_turn_is_a_malformed_call_whatever_its_text():
    t = HELDOUT[0]
    env = bugfix.BugFixEnv()
    env.reset(t)
    for n, text in enumerate([f'<call> edit {t.bug} </call>', '<call> submit </call>', '<call> read </call>'], 1):
        obs, reward, done, info = env.step(text, 'length')  # well formed, yet not run
        assert (obs, reward, done, info['n_turns'], info['n_invalid'], info['n_edits']) == \
            ('error : malformed call', 0.0, False, n, n, 0)
    assert env.source == t.source and env.step('<call> read </call>')[0] == code.read_observation(t.source)


CUT_WORDS = [TOK.stoi[w] for w in ['<call>', '</call>', 'edit', 'read', 'undo', 'test', 'submit', 'fix_init',
                                   'fix_index', '<nl>', '<obs>', '<pad>']] + [TOK.unk_id]


CUT_CALLS = [TOK.encode(f'<call> {c} </call>') for c in ('read', 'test', 'undo', 'submit', f'edit {HELDOUT[3].bug}')]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.lists(st.sampled_from(CUT_WORDS), max_size=5),
                          st.tuples(st.sampled_from(CUT_CALLS), st.integers(0, 4)).map(lambda c: c[0][:c[1]])),
                min_size=1, max_size=14))
def test_finish_length_steps_exactly_as_the_unterminated_text_did(turns):
    # the tiny gym's numbers must not move: a response without its stop token </call> never parsed
    # (a call's last word is </call>, and every id decodes to one word), so 'length' changes nothing
    new, old = bugfix.BugFixEnv(), bugfix.BugFixEnv()
    new.reset(HELDOUT[3]), old.reset(HELDOUT[3])
    for ids in turns:
        finish = 'stop' if ids and ids[-1] == TOK.call_end_id else 'length'  # rollout.py's rule
        text = TOK.decode(ids)
        assert new.step(text, finish) == old.step(text)  # old: no finish argument (the code before it)
