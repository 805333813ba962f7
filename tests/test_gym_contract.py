"""The gym contract (gym.py): every gym in gyms/ conforms, and load_gym / the rollout refuse what
breaks it with one line."""
import json
import os
import random

import pytest

import gym
import report
from config import config, load_config
from gym import STOPS, SETUP_KEYS, WordTokenizer, build_tokenizer, load_gym, word_format
from rollout import rollout_batch, run_tasks

GYMS = gym.gym_modules()  # every gyms/<name>.py with a setup, found as load_gym finds them


def small_cfg(name, *args, model=None):
    """A config for gym `name` at test sizes: its own kind of model, few tasks, room for 20 turns."""
    mod = GYMS[name]
    sizes = {'train_tasks': 8, 'train_variants': 1}
    model = model or ('tiny-qwen3' if mod.MODEL == 'hf' else 'tiny')
    return load_config([f'--gym={name}', f"--model={model}",
                        '--eval_tasks=2', '--max_turns=20', '--max_len=4096', '--out_dir=unused',
                        *[f'--{k}={v}' for k, v in sizes.items() if k in mod.KEYS], *args])


def load_fails(capsys, cfg, **kw):
    """load_gym's one-line error (it exits with status 2)."""
    with pytest.raises(SystemExit) as e:
        load_gym(cfg, **kw)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1 and err.startswith('error: '), err
    return err.strip()[len('error: '):]


def test_the_gyms_are_found():
    assert {'bugfix', 'memory', 'searchqa', 'quixbugs'} <= set(GYMS) and not {'sandbox', 'bugfix_code'} & set(GYMS)


@pytest.mark.parametrize('name,model', [(n, m) for n in sorted(GYMS) for m in ('tiny', 'tiny-qwen3')
                                        if GYMS[n].MODEL in ('any', {'tiny-qwen3': 'hf'}.get(m, m))])
def test_every_gym_keeps_the_contract(name, model):
    mod = GYMS[name]
    assert mod.MODEL in ('tiny', 'hf', 'any') and isinstance(mod.KEYS, tuple) and set(mod.KEYS) <= set(config)
    assert isinstance(getattr(mod, 'TASK_KEYS', ()), tuple) and set(getattr(mod, 'TASK_KEYS', ())) <= set(mod.KEYS)
    cfg = small_cfg(name, model=model)
    g = load_gym(cfg, defaults=config)
    assert set(SETUP_KEYS) <= set(g) and isinstance(g['fmt'], gym.Format)
    assert g['train_tasks'] and g['eval_tasks'] and isinstance(g['baselines'], dict)
    assert (g['answer_text'] is None) == (getattr(mod, 'answer_text', None) is None)
    tasks = g['eval_tasks'][:2]
    assert all(isinstance(g['make_env']().reset(t), str) for t in tasks)
    if model == 'tiny':
        assert isinstance(g['tok'], WordTokenizer)
        assert load_gym(cfg, vocab=g['tok'].itos)['tok'].itos == g['tok'].itos  # a checkpoint's words: same ids
    rng = random.Random(0)
    # the warm-start script if there is one, else a policy that writes nothing (every turn malformed):
    # either way the gym itself ends each episode, within its budget
    policies = [g['warm_policy'](rng) if g['warm_policy'] else (lambda ep: '') for _ in tasks]
    trajs = run_tasks(policies, g, cfg, tasks)
    for t in trajs:
        assert isinstance(t.info['success'], bool) and t.info['stop'] in STOPS
        assert t.info['stop'] not in ('max_len', 'max_turns', 'env_error') and t.valid, t.info
    if g['answer_text'] is not None:
        assert all(isinstance(g['answer_text'](t), str) for t in tasks)

# -----------------------------------------------------------------------------
# what the rollout refuses


class Env:
    """Ends at the first step with `info`."""
    def __init__(self, info):
        self.info = info

    def reset(self, task):
        return 'task'

    def step(self, action, finish='stop'):
        return '', 1.0, True, dict(self.info)


class NoSuccessEnv(Env):
    pass


@pytest.mark.parametrize('env, needle', [
    (NoSuccessEnv(dict(stop='submit')), "NoSuccessEnv.step returned done=True without info['success']"),
    (Env(dict(success=True)), "Env.step returned done=True without info['stop']"),
    (Env(dict(success=True, stop='won')), "Env.step returned done=True with info['stop']='won', not one of gym.STOPS"),
])
def test_a_done_info_without_success_or_a_known_stop_stops_the_run(env, needle):
    tok = build_tokenizer(['task read'])
    cfg = dict(max_turns=4, max_len=64, max_response_tokens=4, keep_tool_results='all', temperature=1.0)
    with pytest.raises(ValueError) as e:  # raised, not an invalid episode with success 0
        rollout_batch([lambda ep: '<call> read </call>'], word_format(tok), [env], [0], cfg)
    assert needle in str(e.value) and '\n' not in str(e.value)

# -----------------------------------------------------------------------------
# what load_gym refuses, in one line


@pytest.mark.parametrize('name', ['nope', 'sandbox', '__init__'])
def test_unknown_gym(capsys, name):
    cfg = load_config([f'--gym={name}'])
    assert load_fails(capsys, cfg) == f"unknown gym {name!r}; the gyms: {', '.join(sorted(GYMS))}"


def test_model_of_the_wrong_kind(capsys):
    assert load_fails(capsys, load_config(['--gym=bugfix', '--model=smollm2'])) == \
        "gym 'bugfix' builds its own word vocabulary for model: tiny, not 'smollm2'"
    assert load_fails(capsys, load_config(['--gym=searchqa'])) == \
        "gym 'searchqa' needs a Hugging Face chat model (model: tiny-qwen3, smollm2 or a name/path)"


def test_a_gym_specific_key_the_gym_does_not_read(capsys):
    cfg = load_config(['--gym=bugfix', '--train_tasks=5'])
    assert load_fails(capsys, cfg, defaults=config) == "config key 'train_tasks' is not used by gym 'bugfix'"
    cfg = load_config(['--gym=memory', '--enable_thinking=true'])
    assert load_fails(capsys, cfg, defaults=config) == "config key 'enable_thinking' is not used by gym 'memory'"


def test_mem_coef_needs_a_gym_with_answer_text(capsys):
    mem = ', '.join(n for n, m in GYMS.items() if getattr(m, 'answer_text', None))
    assert {'memory', 'searchqa'} <= set(mem.split(', ')) and 'bugfix' not in mem
    assert load_fails(capsys, load_config(['--gym=bugfix', '--mem_coef=1'])) == \
        f"config key 'mem_coef' (1.0) needs a gym whose turns write <mem> ({mem}), not 'bugfix'"


def test_setup_must_return_every_key(capsys, monkeypatch):
    setup = GYMS['memory'].setup
    monkeypatch.setattr(GYMS['memory'], 'setup', lambda cfg, vocab=None: {
        k: v for k, v in setup(cfg, vocab).items() if k != 'baselines'})
    assert load_fails(capsys, small_cfg('memory')) == \
        "gym 'memory': setup returned no 'baselines' (gym.py lists what setup returns)"
    monkeypatch.setattr(GYMS['memory'], 'setup', lambda cfg, vocab=None: None)
    assert load_fails(capsys, small_cfg('memory')) == \
        "gym 'memory': setup returned NoneType, not a dict (gym.py lists what setup returns)"

# -----------------------------------------------------------------------------
# the tiny vocabulary is closed


def test_encoding_a_word_outside_the_vocabulary_raises():
    tok = build_tokenizer(['read the code'])
    assert tok.decode(tok.encode('read\nthe code')) == 'read <nl> the code'
    with pytest.raises(ValueError, match="word 'seventeen' is not in the tiny vocabulary of this gym"):
        tok.encode('read seventeen')


def test_a_checkpoint_vocabulary_that_lacks_a_word_of_the_gym(capsys):
    cfg = small_cfg('memory')
    words = load_gym(cfg)['tok'].itos
    assert load_fails(capsys, cfg, vocab=[w for w in words if w != 'ada']) == \
        "the checkpoint's vocabulary lacks 1 words of gym 'memory' (e.g. 'ada')"
    tok = build_tokenizer(['b a'], vocab=['<pad>', 'x', 'a', 'b'])  # the checkpoint's ids, not sorted ones
    assert tok.encode('a b') == [17, 18] and tok.missing == []


def test_a_scripted_word_outside_the_vocabulary_stops_before_rl(tmp_path, monkeypatch, capsys):
    """The example gym with a scripted player that guesses 17 (not a word of its texts): the warm start
    stops the run with one line naming the word (it used to train on 'guess <unk>')."""
    import gyms.example as ex
    import train
    monkeypatch.setattr(ex, 'consistent_guesser', lambda rng: (lambda ep: '<call> guess 17 </call>'))
    with pytest.raises(SystemExit) as e:
        train.main(['config/example.yaml', '--warmstart_episodes=4', '--warmstart_steps=2', f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1
    assert err.startswith("error: warm start: word '17' is not in the tiny vocabulary") and not (tmp_path / 'metrics.jsonl').exists()


def test_a_broken_gym_file_stops_only_its_own_gym(tmp_path, monkeypatch, capsys):
    """A half-written gyms/<name>.py (a syntax error) or one without MODEL: asking for it is one line
    naming the file; every other gym still loads."""
    import gym
    import gyms
    folder = tmp_path / 'gyms'
    folder.mkdir()
    for f in gym.GYMS.glob('*.py'):
        (folder / f.name).write_text(f.read_text())
    (folder / 'halfdone.py').write_text('def setup(cfg, vocab=None:\n')
    (folder / 'nomodel.py').write_text('KEYS = ()\ndef setup(cfg, vocab=None):\n    return {}\n')
    (folder / 'badtaskkeys.py').write_text("MODEL = 'any'\nKEYS = ('data',)\nTASK_KEYS = 'data'\ndef setup(cfg, vocab=None):\n    return {}\n")
    monkeypatch.setattr(gym, 'GYMS', folder)
    monkeypatch.setattr(gyms, '__path__', [str(folder)])
    assert load_gym(small_cfg('example'), None, config)['train_tasks']
    for name, needle in (('halfdone', 'gyms/halfdone.py does not import: SyntaxError'),
                         ('nomodel', 'gyms/nomodel.py defines no MODEL'),
                         ('badtaskkeys', "gyms/badtaskkeys.py: TASK_KEYS is 'data'; it must be a tuple of its KEYS")):
        with pytest.raises(SystemExit):
            load_gym(dict(small_cfg('example'), gym=name), None, config)
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and needle in err, err


def test_reset_must_return_the_prompt_text():
    class NoPrompt:
        def reset(self, task):
            return None
    with pytest.raises(gym.GymContractError, match='NoPrompt.reset returned NoneType, not the prompt text'):
        rollout_batch([lambda ep: 'x'], word_format(build_tokenizer(['x'])), [NoPrompt()], [0], dict(config, max_turns=2))


def test_a_gym_whose_step_breaks_in_every_episode_stops_with_one_line(tmp_path, monkeypatch, capsys):
    """A forked gym whose step returns 3 values in every episode used to train 'successfully' on invalid
    episodes with success 0; now the first such step stops the run with one line naming the env."""
    import gyms.example as ex
    import train
    monkeypatch.setattr(ex.GuessEnv, 'step', lambda self, action, finish='stop': ('obs', 0.0, False))
    with pytest.raises(SystemExit) as e:
        train.main(['config/example.yaml', '--warmstart_episodes=4', '--warmstart_steps=2', f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1, err
    assert err == 'error: warm start: GuessEnv.step returned tuple of 3, not (observation, reward, done, info)\n'


def test_a_gym_whose_step_breaks_sometimes_warns_once_and_counts_them(tmp_path, monkeypatch, capsys):
    import gyms.example as ex
    import train
    step = ex.GuessEnv.step

    def flaky(self, action, finish='stop'):
        if self.secret % 3 == 0:
            return 'obs', None, True, dict(success=False, stop='over')  # a reward of None
        return step(self, action, finish)
    monkeypatch.setattr(ex.GuessEnv, 'step', flaky)
    monkeypatch.setattr(report, '_WARNED', set())
    collated, collate = [], train.collate
    monkeypatch.setattr(train, 'collate', lambda trajs, *a: collated.append([t.valid for t in trajs]) or collate(trajs, *a))
    train.main(['config/example.yaml', '--warmstart_episodes=8', '--warmstart_steps=2', '--steps=2', '--eval_every=0',
                f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert err.count('warning: warm start: ') == 1 and err.count('warning: RL: ') == 1  # once each, not every step
    assert 'invalid (reward 0, not imitated)' in err and collated[0] and all(collated[0])  # the warm start's batch
    assert 'episodes invalid' in err and "the first: reward None is a NoneType, not a number (int or float)" in err
    rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert all(r['invalid_episodes'] > 0 for r in rows if r['step'] > 0)
    evals = [r for r in rows if 'eval_success_rate' in r]  # step 0 and the last step: the sampled evaluation's count
    assert len(evals) == 2 and all(r['eval_invalid_episodes'] > 0 for r in evals)


def test_a_reset_without_text_stops_before_the_warm_start(tmp_path, monkeypatch, capsys):
    import gyms.example as ex
    import train
    monkeypatch.setattr(ex.GuessEnv, 'reset', lambda self, task: None)
    with pytest.raises(SystemExit) as e:
        train.main(['config/example.yaml', f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == 'error: GuessEnv.reset returned NoneType, not the prompt text (str)\n'


def test_a_step_without_text_stops_in_one_line(tmp_path, monkeypatch, capsys):
    """An observation that is not a str broke deep in the tokenizer (AttributeError: 'NoneType' has no
    attribute 'replace'); now the run stops at the first such step with one line naming the env."""
    import gyms.example as ex
    import train
    step = ex.GuessEnv.step
    monkeypatch.setattr(ex.GuessEnv, 'step', lambda self, *a: (None, *step(self, *a)[1:]))
    with pytest.raises(SystemExit) as e:
        train.main(['config/example.yaml', '--warmstart_episodes=4', '--warmstart_steps=2', f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == 'error: warm start: GuessEnv.step returned an observation of type NoneType, not text (str)\n'


def test_a_reward_before_the_episode_ends_stops_in_one_line(tmp_path, monkeypatch, capsys):
    """Rewards are per episode: a forked gym that pays per turn had those rewards dropped without a word."""
    import gyms.example as ex
    import train
    step = ex.GuessEnv.step
    monkeypatch.setattr(ex.GuessEnv, 'step', lambda self, *a: (lambda o, r, d, i: (o, r if d else 0.5, d, i))(*step(self, *a)))
    with pytest.raises(SystemExit) as e:
        train.main(['config/example.yaml', '--warmstart_episodes=4', '--warmstart_steps=2', f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == ('error: warm start: GuessEnv.step returned reward 0.5 before done; rewards are '
                                         'per episode, given with done=True\n')


def test_an_update_gone_non_finite_logs_no_loss_and_stops(tmp_path, capsys):
    """lr 1e30: the first update makes the weights non-finite, every later optimizer step is skipped.
    Those steps log loss and grad_norm as null (they logged 0.0, a flat healthy-looking curve), and
    after max_bad_steps such steps in a row the run stops with an error line (exit 1: not bad input).
    A KL term keeps a gradient once every reward is 0 (without one such a step would not step)."""
    import train
    with pytest.raises(SystemExit) as e:
        train.main(['config/example.yaml', '--lr=1e30', '--warmup_steps=0', '--steps=8', '--eval_every=0',
                    '--warmstart_steps=100', '--max_bad_steps=2', '--kl_coef=0.05', f'--out_dir={tmp_path}'])  # 100: some success
    err = capsys.readouterr().err
    assert e.value.code == 1 and 'error: stopping at step 2: 2 steps in a row had a non-finite loss' in err
    first, second = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')][1:]
    assert first['bad_steps'] == 1 and first['loss'] > 0 and first['grad_norm'] > 0  # its first mini-batch stepped
    assert second['bad_steps'] == 2 and second['loss'] is None and second['grad_norm'] is None  # both skipped


class _OneTurn:
    """An env whose only turn ends the episode with a given reward."""
    def __init__(self, reward=1.0):
        self.reward = reward

    def reset(self, task):
        return 'x'

    def step(self, action, finish='stop'):
        return '', self.reward, True, dict(success=True, stop='over')


def test_a_reward_that_is_not_a_number_makes_the_episode_invalid():
    fmt, cfg = word_format(build_tokenizer(['x'])), dict(config, max_turns=2)
    for reward, valid in (('1', False), (True, False), (None, False), (float('nan'), False), (1, True), (0.5, True)):
        t = rollout_batch([lambda ep: 'x'], fmt, [_OneTurn(reward)], [0], cfg)[0]
        assert t.valid == valid and t.reward == (reward if valid else 0.0), reward
        assert valid or t.info['error'] == (f'reward {reward!r} is a {type(reward).__name__}, not a number (int or float)'
                                            if reward == reward else 'reward nan is not a finite number')
        assert t.info['success'] == valid  # the gym said success; an episode whose reward is dropped is not one


def test_a_step_info_that_is_not_a_dict_stops_in_one_line():
    class BadInfo(_OneTurn):
        def step(self, action, finish='stop'):
            return 'obs', 0.0, False, 'oops'
    with pytest.raises(gym.GymContractError, match='^BadInfo.step returned info of type str, not a dict$'):
        rollout_batch([lambda ep: 'x'], word_format(build_tokenizer(['x', 'obs'])), [BadInfo()], [0], dict(config, max_turns=2))


def test_a_reset_that_raises_stops_before_the_warm_start_naming_the_task(tmp_path, monkeypatch, capsys):
    import gyms.example as ex
    import train

    def reset(self, task):
        raise KeyError('no such secret')
    monkeypatch.setattr(ex.GuessEnv, 'reset', reset)
    with pytest.raises(SystemExit) as e:
        train.main(['config/example.yaml', f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1, err
    assert err.startswith("error: GuessEnv.reset raised KeyError: 'no such secret' (task ")
    assert not os.listdir(tmp_path)  # refused before the run made anything


@pytest.mark.parametrize('said', [3, None, ('x', 'no'), ('x', False, 1)])
def test_a_scripted_policy_returns_text_or_text_and_false(said):
    fmt, cfg = word_format(build_tokenizer(['x'])), dict(config, max_turns=2)
    with pytest.raises(gym.GymContractError, match='a scripted policy returned .*; it returns the turn.s text, or '
                                                   r'\(text, False\) for a mistake not to train on'):
        rollout_batch([lambda ep: said], fmt, [_OneTurn()], [0], cfg)
    t = rollout_batch([lambda ep: ('x', False)], fmt, [_OneTurn()], [0], cfg)[0]
    assert t.reward == 1.0 and [tr['train'] for tr in t.turns] == [False]


def test_a_scripted_policy_that_raises_is_named_in_one_line(tmp_path, capsys):
    import train
    fmt, cfg = word_format(build_tokenizer(['x'])), dict(config, max_turns=2)
    with pytest.raises(gym.GymContractError, match="the gym's scripted policy raised IndexError: list index"):
        rollout_batch([lambda ep: [][0]], fmt, [_OneTurn()], [0], cfg)
    # the example gym's warm policy reads only well-formed answers: a cut turn no longer breaks it
    train.main(['config/example.yaml', '--max_response_tokens=2', '--warmstart_episodes=8', '--warmstart_steps=2',
                '--steps=0', '--eval_tasks=2', '--eval_samples=1', f'--out_dir={tmp_path}'])
    assert 'scripted turns are cut at max_response_tokens=2' in capsys.readouterr().err


def test_a_gym_with_an_unknown_model_kind_or_a_key_without_default_stops_only_itself(tmp_path, monkeypatch, capsys):
    import gyms
    folder = tmp_path / 'gyms'
    folder.mkdir()
    for f in gym.GYMS.glob('*.py'):
        (folder / f.name).write_text(f.read_text())
    example = (gym.GYMS / 'example.py').read_text()
    assert "MODEL = 'tiny'" in example and 'KEYS = ()' in example
    (folder / 'badmodel.py').write_text(example.replace("MODEL = 'tiny'", "MODEL = 'tinyy'"))
    (folder / 'newkey.py').write_text(example.replace('KEYS = ()', "KEYS = ('my_new_key',)"))
    monkeypatch.setattr(gym, 'GYMS', folder)
    monkeypatch.setattr(gyms, '__path__', [str(folder)])
    assert load_gym(small_cfg('example'), None, config)['train_tasks']  # the other gyms still load
    for name, needle in (('badmodel', "gyms/badmodel.py: MODEL is 'tinyy'; it must be 'tiny', 'hf' or 'any'"),
                         ('newkey', "gyms/newkey.py lists 'my_new_key' in KEYS, but config.py has no default for it")):
        with pytest.raises(SystemExit):
            load_gym(dict(small_cfg('example'), gym=name), None, config)
        err = capsys.readouterr().err
        assert err == f'error: {needle}\n', err


def test_sample_py_meets_a_broken_gym_with_one_line(monkeypatch, capsys):
    """sample.py used to print a traceback where train.py prints one line."""
    import gyms.example as ex
    import sample
    monkeypatch.setattr(ex.GuessEnv, 'step', lambda self, action, finish='stop': ('obs', 0.0, False))
    for extra in (['--n=1'], ['--eval', '--eval_tasks=1']):
        with pytest.raises(SystemExit) as e:
            sample.main(['config/example.yaml', '--scripted', *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == 'error: GuessEnv.step returned tuple of 3, not (observation, reward, done, info)\n'


def test_eval_tasks_takes_the_first_of_a_gym_that_returns_all(tmp_path):
    """The example gym returns all 8 secrets as held-out tasks; --eval_tasks=4 was saved as 4 and
    evaluated 8. load_gym takes the first eval_tasks of them, for every gym and fork."""
    cfg = load_config(['config/example.yaml', '--eval_tasks=4', f'--out_dir={tmp_path}'])
    assert load_gym(cfg)['eval_tasks'] == [0, 1, 2, 3]
    assert len(load_gym(dict(cfg, eval_tasks=0))['eval_tasks']) == 8  # 0 = all of them


def _break_odd_secrets(monkeypatch, error):
    """The example gym's env raises RuntimeError(error) in the episodes whose secret is odd; returns its own step."""
    import gyms.example as ex
    step = ex.GuessEnv.step

    def flaky(self, action, finish='stop'):
        if self.secret % 2:
            raise RuntimeError(error)
        return step(self, action, finish)
    monkeypatch.setattr(ex.GuessEnv, 'step', flaky)
    return step


def test_sample_py_eval_names_the_episodes_a_raising_env_made_invalid(monkeypatch, capsys):
    """An env that raises in some episodes ends them invalid (reward 0); sample.py --eval counted them
    only in the JSON's stops ('env_error'): not on the line a user reads, without the error, and with
    exit 0 when every episode was invalid. Now it warns and stops as train.py does."""
    import gyms.example as ex
    import sample
    step = _break_odd_secrets(monkeypatch, 'tool server down')
    monkeypatch.setattr(report, '_WARNED', set())
    numbers = sample.main(['config/example.yaml', '--eval', '--scripted', '--eval_tasks=4'])
    out = capsys.readouterr()
    line = out.out.splitlines()[-2]
    assert numbers['invalid_episodes'] == 2 == numbers['stops']['env_error'] and line.endswith(', invalid_episodes 2')
    assert out.err == ('warning: evaluation (held-out, scripted): 2 of 4 episodes invalid (reward 0); the first: '
                       'RuntimeError: tool server down\n')  # why, in one line, as train.py says it
    monkeypatch.setattr(ex.GuessEnv, 'step', lambda self, action, finish='stop': 1 / 0)
    with pytest.raises(SystemExit) as e:  # every episode invalid: the gym is broken, as train.py stops
        sample.main(['config/example.yaml', '--eval', '--scripted', '--eval_tasks=4'])
    assert e.value.code == 2 and capsys.readouterr().err == ('error: evaluation (held-out, scripted): every episode is invalid; '
                                                             'the first: ZeroDivisionError: division by zero\n')
    monkeypatch.setattr(ex.GuessEnv, 'step', step)
    sample.main(['config/example.yaml', '--eval', '--scripted', '--eval_tasks=4'])
    assert 'invalid_episodes' not in capsys.readouterr().out.splitlines()[-2]  # said only when it happened


def test_eval_of_the_training_split_takes_eval_tasks_as_its_count(monkeypatch, capsys):
    """--split=train --eval_tasks=N evaluates the first N training tasks; it was refused with the
    held-out message ('asks for N held-out tasks') when the gym has fewer than N held-out ones."""
    import gyms.example as ex
    import sample
    setup = ex.setup
    monkeypatch.setattr(ex, 'setup', lambda cfg, vocab=None: dict(setup(cfg, vocab), eval_tasks=[0, 1, 2]))
    numbers = sample.main(['config/example.yaml', '--eval', '--scripted', '--split=train', '--eval_tasks=5'])
    assert numbers['tasks'] == 5 and ' 5 training example tasks ' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # the held-out split keeps its refusal
        sample.main(['config/example.yaml', '--eval', '--scripted', '--eval_tasks=5'])
    assert e.value.code == 2 and "asks for 5 held-out tasks" in capsys.readouterr().err


def test_the_episode_views_say_which_episodes_are_invalid_and_why(tmp_path, monkeypatch, capsys):
    """sample.py's episodes: the summary line counts the invalid ones and the HTML page gives each one's
    error (it said INVALID without it), escaped."""
    import sample
    _break_odd_secrets(monkeypatch, 'tool <server> down')
    page = tmp_path / 'episodes.html'
    sample.main(['config/example.yaml', '--scripted', '--n=4', '--greedy', f'--html={page}'])
    summary = capsys.readouterr().out.splitlines()[-2]
    assert summary.startswith('4 episodes: ') and summary.endswith(', invalid 2'), summary
    assert page.read_text().count('INVALID RuntimeError: tool &lt;server&gt; down') == 2
