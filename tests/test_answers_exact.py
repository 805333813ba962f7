import json
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch

import gym
from advantage import memory_advantage, memory_rewards
from gym import build_tokenizer, word_format
from gyms import answers
from gyms import memory as gm
from gyms import searchqa as gs
from model import TinyAgent
from rollout import rollout_batch

CFG = dict(max_turns=8, max_len=256, max_response_tokens=24, keep_tool_results=1, temperature=1.0, device='cpu',
           max_tokens_per_microbatch=16384)

# -----------------------------------------------------------------------------
# the memory reward scores well-formed turns only


def memory_setup():
    """The tiny memory format and an untrained TinyAgent (seed 0)."""
    tok = build_tokenizer(gm.memory_texts())
    torch.manual_seed(0)
    return word_format(tok, memory=True), TinyAgent(tok.vocab_size, 2, 4, 64, 256).eval()


def test_malformed_or_cut_turn_gets_no_memory_reward_and_leaves_the_pool():
    fmt, model = memory_setup()
    task = gm.make_tasks('train', 1, seed=7, n_objectives=(1, 1), hops=(2, 2))[0]
    oracle = gm.folded_policy(gm.oracle_policy)
    bad = 'pia kastel located in </mem> bo <search> kastel located in </search>'  # text between the tags
    t = rollout_batch([lambda ep: bad if len(ep.turns) == 1 else oracle(ep)], fmt, [gm.MemoryEnv()], [task], CFG)[0]
    assert t.info['format_reason'] == 'turn 2: text outside tags' and len(t.turns) == 4
    assert all(turn['mem_len'] > 0 for turn in t.turns)  # every turn has a closed <mem> span
    mem_r, valid = memory_rewards(model, [t], fmt, [gm.answer_text(task)], CFG)  # [1, 4] each
    assert valid.tolist() == [[False, False, True, True]] and mem_r[0, 1] == 0
    adv = memory_advantage(mem_r, valid, torch.tensor([0]), eps=0.0)
    assert adv[0, 1] == 0 and adv[0, 2:].abs().sum() > 0  # the pool is turns 2 and 3 alone
    t.turns[3]['ok'] = False  # the gym's verdict (info['turn_ok']) decides, whatever the text
    assert memory_rewards(model, [t], fmt, [gm.answer_text(task)], CFG)[1].tolist() == [[False, False, True, False]]
    t.turns[3]['ok'] = True
    t.turns[2]['finish'] = 'length'  # cut at the response limit: malformed whatever its text
    assert memory_rewards(model, [t], fmt, [gm.answer_text(task)], CFG)[1].tolist() == [[False, False, False, True]]

# -----------------------------------------------------------------------------
# invisible format characters (Unicode Cf) do not change an answer


@pytest.mark.parametrize('mark', ['\u200b', '\u200e', '\u200f', '\ufeff', '\u00ad', '\u2060'])
def test_format_characters_are_deleted_before_em_and_f1(mark):
    assert answers.em('Paris' + mark, 'Paris') == 1.0 and answers.f1('Paris' + mark, ['Paris']) == 1.0
    assert answers.em('Mana Al Otaiba' + mark, 'Mana Al Otaiba') == 1.0
    assert answers.f1('Mana Al Otaiba' + mark, 'Mana Al Otaiba') == 1.0
    assert answers.normalize_answer(f'\u2212{mark}5') == '-5'  # a sign keeps its digit across a mark
    assert answers.em(mark, [mark, '']) == 0.0  # nothing but a mark is an empty answer


def test_both_qa_gyms_score_with_the_one_normaliser():
    assert gm.score_episode is gs.score_episode is answers.score_episode  # answers.score_answers -> em, f1


def test_memory_gym_rewards_an_answer_written_with_a_mark():
    """The oracle's episode, its answer written with a left-to-right mark."""
    task = gm.make_tasks('train', 1, seed=7, n_objectives=(1, 1), hops=(2, 2))[0]
    marked = lambda q, m, o: gm.oracle_policy(q, m, o).replace(' </answer>', '\u200e </answer>')
    *_, reward, info = gm.play(task, marked)
    assert '\u200e' in info['answer'] and reward == 1.0 and info['success']


def test_searchqa_rewards_a_span_copied_with_its_mark(tmp_path):
    """A span copied from a passage with its U+200E, as our HotpotQA sample's passages hold 50."""
    corpus = tmp_path / 'docs.jsonl'
    corpus.write_text(json.dumps({'text': 'Mana Al Otaiba: Mana Al Otaiba (Arabic: \u0645\u0627\u0646\u0639\u200e ) is a poet.'}))
    env = gs.SearchQAEnv(corpus=corpus)
    env.reset(gs.SearchTask('t', 'Which poet?', [['Mana Al Otaiba']]))
    env.step('\nnothing yet\n</mem>\n<think>\nlook\n</think>\n<search>Mana Al Otaiba poet</search>')
    _, r, done, info = env.step('\npoet\n</mem>\n<think>\ndone\n</think>\n<answer>Mana Al Otaiba\u200e</answer>')
    assert done and r == 1.0 and (info['em'], info['f1']) == (1.0, 1.0) and info['success']


def test_a_format_character_between_a_letter_and_its_accent_still_composes():
    """The marks go before NFKC, so "e" + U+200B + a combining acute is the composed letter."""
    from gyms.answers import em
    assert em('e\u200b\u0301', '\u00e9') == 1.0


# -----------------------------------------------------------------------------
# the memory reward's target and episodes (mem_target, mem_success_only)


def test_found_target_scores_only_the_answers_found_before_the_turn():
    from advantage import answer_pieces
    fmt, model = memory_setup()
    task = gm.make_tasks('train', 1, seed=3, n_objectives=(2, 2), hops=(2, 2))[0]
    gold = gm.answer_text(task)
    ids, score = answer_pieces(fmt, gold, 1)
    assert ids == answer_pieces(fmt, gold)[0]  # word level: the parts encode to the same ids
    assert fmt.decode([i for i, s in zip(ids, score) if s]) == task.golds[0][0]
    t = rollout_batch([gm.folded_policy(gm.oracle_policy)], fmt, [gm.MemoryEnv()], [task], CFG)[0]
    found = t.info['answers_found_turns']  # objectives answered by facts found before each turn
    assert t.info['success'] and found[0] == 0 and found == sorted(found) and found[-1] == 2
    whole = memory_rewards(model, [t], fmt, [gold], CFG)[1][0].tolist()
    kept = memory_rewards(model, [t], fmt, [gold], dict(CFG, mem_target='found'))[1][0].tolist()
    assert kept == [w and n > 0 for w, n in zip(whole, found)] and any(kept) and kept != whole
    t.info['success'] = False
    assert not memory_rewards(model, [t], fmt, [gold], dict(CFG, mem_success_only=True))[1].any()


def test_no_baseline_rewards_p_mem_alone_and_keeps_turns_whose_history_is_long():
    """mem_baseline: none: the reward of a turn is its P_mem (the same number MemPO's reward starts
    from), and a turn whose full history would not fit max_len is still scored: no history is run."""
    from advantage import memory_probs
    fmt, model = memory_setup()
    task = gm.make_tasks('train', 1, seed=3, n_objectives=(2, 2), hops=(2, 2))[0]
    gold = gm.answer_text(task)
    t = rollout_batch([gm.folded_policy(gm.oracle_policy)], fmt, [gm.MemoryEnv()], [task], CFG)[0]
    where, p_full, p_mem = memory_probs(model, [t], fmt, [gold], CFG)
    assert len(where) >= 3 and (p_full > 0).all()
    rewards, valid = memory_rewards(model, [t], fmt, [gold], dict(CFG, mem_baseline='none'))
    assert [rewards[0, k].item() for _, k in where] == p_mem.tolist() and valid.sum() == len(where)
    cut = dict(CFG, max_len=len(t.ids) - 2)  # the last turn's history and answer no longer fit
    assert memory_rewards(model, [t], fmt, [gold], cut)[1].sum() < len(where)
    assert memory_rewards(model, [t], fmt, [gold], dict(cut, mem_baseline='none'))[1].sum() == len(where)
