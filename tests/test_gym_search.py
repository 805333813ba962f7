import json
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest

from gyms import searchqa as gs

SEARCH = '\nnothing yet\n</mem>\n<think>\nfind the actress\n</think>\n<search>Corliss Archer Kiss and Tell</search>'
ANSWER = '\nShirley Temple was Chief of Protocol\n</mem>\n<think>\ndone\n</think>\n<answer>{}</answer>'


@pytest.fixture(scope='module')
def task():
    return gs.load_jsonl_questions(gs.SOURCES['hotpotqa'])[0]   # Corliss Archer -> Chief of Protocol


def test_bm25_finds_supporting_paragraphs():
    """The question itself as a query: a supporting paragraph is in the top 5 for >= 90% of the
    500 questions (measured 95.4%), both of them for about half."""
    tasks = gs.load_jsonl_questions(gs.SOURCES['hotpotqa'])
    index = gs.get_index()
    assert len(index.docs) == 4943 and gs.get_index() is index   # built once per corpus
    hits = [[doc.split(': ', 1)[0] for doc, _ in index.search(t.question, 5)] for t in tasks]
    found = sum(any(s in h for s in t.supporting_titles) for t, h in zip(tasks, hits))
    assert found / len(tasks) >= 0.9


def test_search_edge_cases():
    index = gs.get_index()
    assert index.search('the of and', 3) == []           # only stop words
    assert index.search('zzqxv', 3) == []                # unknown word
    hits = index.search('Shirley Temple Chief of Protocol', 3)
    assert len(hits) == 3 and hits[0][1] >= hits[1][1] >= hits[2][1] > 0


MINI = ['Malcolm X: Malcolm X was an American Muslim minister and human rights activist.',
        'Malcolm Gladwell: Malcolm Gladwell is a Canadian journalist. Malcolm Gladwell wrote Outliers.',
        'Plan 9 from Outer Space: Plan 9 from Outer Space is a 1957 science fiction film.',
        'Plan B (musician): Plan B is an English rapper; his plan was to make a film.',
        'Stra\u00dfe: a German street.']


def test_one_character_words_are_searchable():
    # bm25s's default token pattern \w\w+ dropped 'X' and '9' from queries and passages
    index = gs.SearchIndex(MINI)
    top = lambda q: [doc.split(': ', 1)[0] for doc, _ in index.search(q, 3)]
    assert top('Malcolm X')[0] == 'Malcolm X' and top('Plan 9')[0] == 'Plan 9 from Outer Space'
    assert top('X') == ['Malcolm X'] and top('9') == ['Plan 9 from Outer Space']
    assert top('STRASSE') == ['Stra\u00dfe']                         # case-folded, as answers are
    assert gs.SearchIndex._tokenize(['Malcolm X, Plan 9 and Vitamin A']) == [
        ['malcolm', 'x', 'plan', '9', 'vitamin', 'a']]               # stop words of two or more letters only


def test_env_scores_answers_like_the_memory_gym(tmp_path):
    corpus = tmp_path / 'docs.jsonl'
    corpus.write_text('\n'.join(json.dumps({'text': d}) for d in MINI))
    env = gs.SearchQAEnv(corpus=corpus)
    t = gs.SearchTask('t', 'q1 ; q2 ; q3 ; q4', [['A'], ['Stra\u00dfe'], ['\u22125 \u00b0C'], ['10.8']])
    for answer, reward, f1 in [('a.; STRASSE; -5 \u00b0C; 10.8', 4.0, 1.0), ('the; strase; 5 \u00b0C; 108', 0.0, 0.125)]:
        env.reset(t)
        env.step(SEARCH.replace('Corliss Archer Kiss and Tell', 'Malcolm X'))
        _, r, done, info = env.step(ANSWER.format(answer))
        assert done and r == reward and info['f1'] == pytest.approx(f1), answer


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.jsonl'):
        gs.load_jsonl_questions(tmp_path / 'nope.jsonl')
    bad = tmp_path / 'bad.jsonl'
    bad.write_text('{"question": "q", "answers": ["a"]}\n\n{"question": "q2", "answers": [\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:3: malformed JSON'):
        gs.load_jsonl_questions(bad)
    bad.write_text('{"question": "q", "answers": ["a"]}\n{"question": "q2", "answers": [""]}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:2: question has no answers'):
        gs.load_jsonl_questions(bad)
    bad.write_text('{"answers": ["a"]}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:1: no question'):
        gs.load_jsonl_questions(bad)
    bad.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:1: expected a JSON object'):
        gs.load_jsonl_questions(bad)
    bad.write_text('\n\n')
    with pytest.raises(ValueError, match='no questions'):
        gs.load_jsonl_questions(bad)
    with pytest.raises(ValueError, match="split 'train' is empty"):
        gs.make_tasks('train', source='bamboogle', heldout_frac=1.0)
    with pytest.raises(ValueError, match='split must be'):
        gs.make_tasks('test')
    with pytest.raises(ValueError, match="config key 'prompt_style' must be 'train' or 'eval'"):
        gs.SearchQAEnv(prompt_style='fancy')


def test_splits_are_deterministic():
    train, held = gs.make_tasks('train', seed=0), gs.make_tasks('heldout', seed=0)
    assert len(train) + len(held) == 500 and not {t.id for t in train} & {t.id for t in held}
    assert 80 <= len(held) <= 120
    assert {t.id for t in gs.make_tasks('heldout', seed=5)} == {t.id for t in held}   # seed only shuffles
    assert [t.id for t in gs.make_tasks('train', seed=0)] == [t.id for t in train]
    assert len(gs.make_tasks('heldout', source='bamboogle', heldout_frac=1.0)) == 125


def test_episode_search_then_answer(task):
    env = gs.SearchQAEnv()
    assert env.reset(task) == task.question                      # training prompt: the bare question
    obs, r, done, info = env.step(SEARCH + '<|im_end|>')         # a decoded stop token is dropped
    assert not done and r == 0.0 and obs.startswith('[1] Kiss and Tell (1945 film): ')
    assert info == dict(n_turns=1, n_invalid=0, n_search=1, turn_ok=True)
    obs, r, done, info = env.step(ANSWER.format('chief of protocol.'))
    assert done and r == 1.0 and info['success'] and info['stop'] == 'answer'
    assert (info['em'], info['f1'], info['format_ok'], info['answer']) == (1.0, 1.0, True, 'chief of protocol.')
    assert env.turns[0].startswith('<mem>\nnothing yet')           # the forced prefix is part of the turn


def test_wrong_answer_and_partial_f1(task):
    env = gs.SearchQAEnv()
    env.reset(task)
    env.step(SEARCH)
    _, r, done, info = env.step(ANSWER.format('Protocol chief'))
    assert done and r == 0.0 and not info['success'] and info['f1'] == pytest.approx(0.8)   # P 2/2, R 2/3


def test_f1_reward_gives_partial_credit_and_keeps_success_exact(task, capsys):
    """answer_reward='f1': the reward is the answer's token F1 (summed over objectives), still 0 for a
    malformed episode; success stays 'every objective exactly right'. A bad value is refused in one line."""
    env = gs.SearchQAEnv(answer_reward='f1')
    for answer, reward, success in [('Protocol chief', 0.8, False), ('chief of protocol', 1.0, True), ('Temple', 0.0, False)]:
        env.reset(task)
        env.step(SEARCH)
        _, r, done, info = env.step(ANSWER.format(answer))
        assert done and r == pytest.approx(reward) and info['success'] is success and info['em'] == float(success)
    env.reset(task)
    env.step('no tags at all')  # a malformed turn: the episode's format fails, so no partial credit
    env.step(SEARCH)
    assert env.step(ANSWER.format('Protocol chief'))[1] == 0.0
    t = gs.make_tasks('train', seed=1, n_objectives=2)[0]
    env.reset(t)
    env.step(SEARCH)
    assert env.step(ANSWER.format(f'{t.golds[0][0]}; wrong'))[1] == pytest.approx(1.0)  # F1 1 + 0
    with pytest.raises(ValueError, match="config key 'answer_reward' expects one of em, f1, all, got 'F1'"):
        gs.SearchQAEnv(answer_reward='F1')
    from config import load_config
    from gym import load_gym
    with pytest.raises(SystemExit) as e:
        load_gym(load_config(['--gym=searchqa', '--model=tiny-qwen3', '--answer_reward=F1']))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "error: config key 'answer_reward' expects one of em, f1, all, got 'F1'\n"


def test_format_failures(task):
    env = gs.SearchQAEnv()
    env.reset(task)
    obs, r, done, info = env.step('just an answer: Chief of Protocol')
    assert obs.startswith('error: bad format') and not done and info['n_invalid'] == 1
    env.step(SEARCH)
    _, r, done, info = env.step(ANSWER.format('Chief of Protocol'))
    assert done and r == 0.0 and not info['format_ok'] and info['em'] == 1.0   # right answer, bad episode
    # answering without a search
    env.reset(task)
    _, r, done, info = env.step(ANSWER.format('Chief of Protocol'))
    assert done and r == 0.0 and info['format_reason'] == 'answered without searching'
    env = gs.SearchQAEnv(require_search=False)
    env.reset(task)
    assert env.step(ANSWER.format('Chief of Protocol'))[1] == 1.0
    # <think> is required by default
    env.reset(task)
    assert env.step('x</mem><search>Kiss and Tell</search>')[0].startswith('error: bad format (turn 1: missing <think>')


def test_max_turns(task):
    env = gs.SearchQAEnv(max_turns=2)
    env.reset(task)
    assert not env.step(SEARCH)[2]
    obs, r, done, info = env.step(SEARCH)
    assert done and r == 0.0 and info['stop'] == 'budget' and obs.startswith('[1]')


def test_multi_objective():
    tasks = gs.make_tasks('train', seed=1, n_objectives=2)
    t = tasks[0]
    assert len(t.golds) == 2 and t.question.count(' ; ') == 1
    env = gs.SearchQAEnv()
    env.reset(t)
    env.step(SEARCH)
    _, r, done, info = env.step(ANSWER.format(f'{t.golds[0][0]}; {t.golds[1][0]}'))
    assert r == 2.0 and info['success'] and info['k'] == 2
    env.reset(t)
    env.step(SEARCH)
    assert env.step(ANSWER.format(f'{t.golds[0][0]}; wrong'))[1] == 1.0


def test_eval_prompt(task):
    p = gs.SearchQAEnv(prompt_style='eval').reset(task)
    assert p.endswith('Question: ' + task.question)
    for tag in ('<mem>', '<think>', '<search>', '<answer>', 'semicolon', 'at least once'):
        assert tag in p


def test_observation_truncation(task):
    words = gs.SearchQAEnv(max_obs_tokens=20).search('Shirley Temple')
    assert len(words.split()) == 20
    assert gs.truncate('a b\nc d', 3) == 'a b\nc' and gs.truncate('a b', 5) == 'a b'

    class CharTokenizer:   # stands in for an HF tokenizer: one token per character
        def __call__(self, text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True):
            return {'offset_mapping': [(i, i + 1) for i in range(len(text))]}
    assert gs.truncate('hello world', 4, CharTokenizer()) == 'hell'


@pytest.mark.slow
def test_observation_truncation_qwen():
    import hf
    tok = hf.qwen_tokenizer()
    obs = gs.SearchQAEnv(tokenizer=tok, max_obs_tokens=50, top_k=5).search('Shirley Temple')
    n = len(tok.encode(obs, add_special_tokens=False))
    assert 45 <= n <= 50 and obs.startswith('[1] ')
    # a document that spells the template's special tokens is cut by the pieces hf.py encodes tool text into
    text = '<|im_end|>\n<|im_start|>assistant ' * 20
    assert 25 <= len(hf._encode(tok, gs.truncate(text, 30, tok))[0]) <= 30


def test_custom_corpus(tmp_path, task):
    corpus = tmp_path / 'docs.jsonl'
    corpus.write_text('\n'.join(json.dumps(d) for d in [
        {'title': 'Shirley Temple', 'text': 'She served as Chief of Protocol of the United States.'},
        {'title': 'Paris', 'text': 'Paris is the capital of France.'},
        {'title': 'Paris', 'text': 'Paris is the capital of France.'}]))
    env = gs.SearchQAEnv(corpus=corpus, top_k=5)
    assert len(env.index.docs) == 2                                # duplicates dropped
    env.reset(task)
    obs = env.step(SEARCH.replace('Corliss Archer Kiss and Tell', 'capital of France'))[0]
    assert obs == '[1] Paris: Paris is the capital of France.'
    assert env.search('zzqxv') == gs.NO_RESULT
    (tmp_path / 'bad.jsonl').write_text('{"title": "x"}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:1'):
        gs.load_corpus(tmp_path / 'bad.jsonl')


def test_step_never_raises(task):
    odd = ['', '   ', '<|im_end|>', '</mem>', '<mem>', 'x</mem><think>y</think><search></search>',
           'x</mem><think>y</think><search>a</search><search>b</search>', '\x00\udcff ünï', '<answer>' * 50,
           'x</mem><think>y</think><answer>a</answer><search>b</search>', 'x</mem><think>y</think><search>' + 'w ' * 5000 + '</search>']
    for text in odd:
        env = gs.SearchQAEnv(max_turns=3)
        env.reset(task)
        obs, r, done, info = env.step(text)
        assert isinstance(obs, str) and r == 0.0 and isinstance(info, dict)
        assert done or info['n_invalid'] + info['n_search'] == 1


def test_cut_turn_is_malformed_whatever_its_text(task):
    # a turn cut at max_response_tokens (finish='length') may end on </search> or
    # </answer> and still be unfinished; it must not search, answer or pass the format check
    env = gs.SearchQAEnv()
    env.reset(task)
    obs, r, done, info = env.step(SEARCH, 'length')
    assert obs.startswith('error: bad format (the turn reached the response length limit')
    assert not done and info == dict(n_turns=1, n_invalid=1, n_search=0, turn_ok=False)
    env.step(SEARCH)
    _, r, done, info = env.step(ANSWER.format('Chief of Protocol'))
    assert done and r == 0.0 and info['em'] == 1.0 and info['format_reason'] == 'turn 1: cut at the response length limit'
    env.reset(task)
    env.step(SEARCH)
    _, r, done, info = env.step(ANSWER.format('Chief of Protocol'), 'length')
    assert not done and r == 0.0 and info['n_invalid'] == 1


@pytest.mark.parametrize('cut', [False, True])
def test_rollout_runs_no_search_for_a_turn_without_its_stop_token(task, cut):
    # through rollout_batch with the real Qwen tokenizer: the rollout appends <|im_end|> to a scripted
    # turn; a budget one token short ends the turn at </search> without it, and that turn is 'length'
    import hf
    from rollout import rollout_batch
    fmt = hf.chat_format(hf.qwen_tokenizer(), memory=True)
    seen = []

    def policy(ep):
        seen.append(ep.texts[-1])
        return SEARCH[1:]  # after the forced '<mem>\n'
    n = len(fmt.encode(SEARCH[1:]) + fmt.end_turn)
    cfg = dict(max_turns=2, max_len=2048, max_response_tokens=n - cut, keep_tool_results='all', temperature=1.0)
    t = rollout_batch([policy], fmt, [gs.SearchQAEnv(max_obs_tokens=50)], [task], cfg)[0]
    assert fmt.decode(t.turns[0]['response']).endswith('</search>')
    if not cut:
        assert seen[1].startswith('[1] Kiss and Tell') and (t.info['n_search'], t.info['n_invalid']) == (2, 0)
    else:
        assert seen[1].startswith('error: bad format') and (t.info['n_search'], t.info['n_invalid']) == (0, 2)
