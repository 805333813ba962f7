"""The warm start of a chat model: the memory gym through the real Qwen tokenizer and its
chat template, a tiny random Qwen3. The scripted oracle's episodes are built by the rollout itself,
so the warm start trains exactly the tokens, the rows and the masks RL would."""
import copy
import random

import pytest
import torch

import hf
import train
from config import config, load_config
from gym import OWNER, load_gym
from model import load_policy, sequence_log_probs
from rollout import collate, rollout_batch, run_tasks


@pytest.fixture(scope='module')
def run():
    cfg = load_config(['--gym=memory', '--model=tiny-qwen3', '--keep_tool_results=1', '--max_objectives=2',
                       '--train_tasks=16', '--eval_tasks=4', '--max_turns=10', '--max_response_tokens=48',
                       '--max_len=512', '--out_dir=unused'])
    g = load_gym(cfg, None, config)
    tasks = [t for t in g['train_tasks'] if len(t.golds) == 2][:2] + [t for t in g['train_tasks'] if len(t.golds) == 1][:1]
    trajs = run_tasks([g['warm_policy'](random.Random(0)) for _ in tasks], g, cfg, tasks)
    return cfg, g, tasks, trajs


def test_oracle_episodes_in_the_chat_template_are_solved_and_end_their_turns(run):
    cfg, g, tasks, trajs = run
    im_end = g['tok'].convert_tokens_to_ids('<|im_end|>')
    for task, t in zip(tasks, trajs):
        assert t.info['stop'] == 'answer' and t.reward == len(task.golds) and t.info['format_ok'], t.info
        assert all(tr['finish'] == 'stop' and tr['response'][-1] == im_end for tr in t.turns)
        # the policy's ids are the scripted text encoded once, then <|im_end|>: no second tokenisation
        assert [tr['response'] for tr in t.turns] == [g['fmt'].encode(a) + [im_end] for a in t.info['actions']]
    # folding: the peak context stays below the un-folded history (ht, what full history would hold)
    assert all(t.info['ht'] > t.info['pt'] for t in trajs if len(t.turns) > 2) and max(len(t.turns) for t in trajs) > 2


def test_warm_start_trains_policy_tokens_only(run):
    cfg, g, tasks, trajs = run
    batch = collate(trajs, g['fmt'].pad_id)
    owner_next = torch.cat([torch.nn.functional.pad(r['owner'][1:], (0, batch['ids'].shape[1] - len(r['owner'])),
                                                    value=-1)[None] for t in trajs for r in t.rows])
    am = batch['action_mask']
    # template, prompt and tool tokens weigh 0; each turn's own response trains once (in a folded row
    # the previous turn's <mem> span is context: it trains in its own row)
    assert not (am.bool() & (owner_next != OWNER['policy'])).any()
    assert am.sum() == sum(len(tr['response']) for t in trajs for tr in t.turns)
    assert am.sum() > 0 and (owner_next == OWNER['prompt']).any() and (owner_next == OWNER['tool']).any()
    prefix = g['fmt'].turn_prefix  # the forced '<mem>\n' is template, never trained
    assert prefix and all(tr['context'][0][-len(prefix):] == prefix and
                          tr['context'][1][-len(prefix):] == [OWNER['template']] * len(prefix) for t in trajs for tr in t.turns)


def test_warm_start_loss_is_the_mean_negative_log_prob_of_the_policy_tokens(run):
    cfg, g, tasks, trajs = run
    model = load_policy(cfg, None)
    batch = collate(trajs, g['fmt'].pad_id)
    idx = torch.tensor([0, 2, 3, len(batch['ids']) - 1])
    loss = train.warm_start_loss(model, batch, idx, cfg)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in idx.tolist():  # row by row, unpadded
            n = int(batch['attention_mask'][i].sum())
            logp = sequence_log_probs(model, batch['ids'][i:i + 1, :n])[0]
            m = batch['action_mask'][i, :n - 1]
            total, count = total - float((logp * m).sum()), count + float(m.sum())
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    loss.backward()  # and it trains: gradients reach the embedding
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


class Replay(torch.nn.Module):
    """A 'model' that writes given episodes: its next token is looked up from the sequence so far, and
    its KV cache is that sequence. Sampling it greedily is RL's rollout path with known outputs."""

    def __init__(self, rows, vocab_size):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.vocab_size = vocab_size
        self.next = {}
        for r in rows:
            ids, trained = r['ids'].tolist(), r['action_mask'].tolist()
            for j in range(len(ids) - 1):
                if trained[j]:  # a row's own response (its context may hold an earlier <mem> span)
                    self.next[tuple(ids[:j + 1])] = ids[j + 1]

    def forward(self, ids, attention_mask=None, position_ids=None, use_cache=True, logits_to_keep=0, cache=None):
        seq = torch.cat([cache[0][0], ids], 1) if cache else ids
        full = attention_mask  # generate passes the mask of the whole sequence so far
        logits = torch.zeros(len(seq), 1, self.vocab_size)
        for b in range(len(seq)):
            logits[b, 0, self.next[tuple(seq[b][full[b].bool()].tolist())]] = 50.0
        out = {'logits': logits, 'cache': [(seq, seq)]}  # a 'KV cache' that select_cache can index
        return type('Out', (dict,), {'__getattr__': dict.__getitem__})(out)


def test_a_warm_started_row_is_the_row_rl_builds_for_the_same_text(run):
    cfg, g, tasks, trajs = run
    replay = Replay([r for t in trajs for r in t.rows], len(g['tok']))
    sampled = rollout_batch(replay, g['fmt'], [g['make_env']() for _ in tasks], tasks, cfg, temperature=0.0)
    for w, s in zip(trajs, sampled):
        assert s.reward == w.reward and len(s.rows) == len(w.rows) == len(w.turns)
        for rw, rs in zip(w.rows, s.rows):
            for key in ('ids', 'owner', 'action_mask', 'turn_ids', 'mem_mask'):
                assert torch.equal(rw[key], rs[key]), key
        assert torch.equal(w.ids, s.ids) and torch.equal(w.mem_mask, s.mem_mask)


def test_a_model_without_the_stop_token_or_a_template_that_cannot_render_stops_at_setup():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = Tokenizer(models.WordLevel({'[UNK]': 0, 'a': 1}, unk_token='[UNK]'))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token='[UNK]', pad_token='[UNK]', name_or_path='toy')
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=r"model 'toy': its chat template writes no end-of-turn token"):
        hf.chat_format(tok, memory=True)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"  # not in its vocabulary
    with pytest.raises(ValueError, match=r"model 'toy': .*'<\|im_end\|>', which does not start with a special token"):
        hf.chat_format(tok, memory=True)
    qwen = copy.deepcopy(hf.qwen_tokenizer())
    qwen.chat_template = "{{ raise_exception('this template has no tool role') }}"
    with pytest.raises(ValueError, match="chat template cannot render the gym's turns .*no tool role"):
        hf.chat_format(qwen, memory=True)


def test_a_stuck_episode_trains_only_the_oracle_turns_and_its_last_turn_answer(run):
    """oracle_stuck through the chat template: the repeated wrong searches weigh 0; the turns before them
    and the answer on the budget's last turn train, and the episode ends well formed, never cut."""
    cfg, g0, tasks, _ = run
    cfg = dict(cfg, oracle_stuck=1.0, show_budget=True)
    g = load_gym(cfg, None, config)
    trajs = run_tasks([g['warm_policy'](random.Random(i)) for i in range(len(tasks))], g, cfg, tasks)
    am = collate(trajs, g['fmt'].pad_id)['action_mask']
    for t in trajs:
        train = [tr['train'] for tr in t.turns]
        assert t.info['stop'] == 'answer' and t.info['format_ok'] and train[-1] and not train[-2]
        assert train == [True] * train.index(False) + [False] * (len(train) - 1 - train.index(False)) + [True]
        last, before = (g['tok'].decode(t.turns[i]['context'][0]) for i in (-1, -2))  # folded: the last observation
        assert 'turns left 1' in last and 'turns left 2' in before  # the answer comes on the last turn
        assert t.action_mask.sum() == sum(len(tr['response']) for tr in t.turns if tr['train'])  # the viewer's mask too
    assert am.sum() == sum(len(tr['response']) for t in trajs for tr in t.turns if tr['train'])


def test_a_demonstrated_mistake_is_played_but_not_trained(run):
    """oracle_detour: the wrong search's tokens weigh 0, the recovery and every other turn train."""
    cfg, g0, tasks, _ = run
    cfg = dict(cfg, oracle_detour=1.0)
    g = load_gym(cfg, None, config)
    trajs = run_tasks([g['warm_policy'](random.Random(i)) for i in range(len(tasks))], g, cfg, tasks)
    am = collate(trajs, g['fmt'].pad_id)['action_mask']
    for task, t in zip(tasks, trajs):
        assert t.info['stop'] == 'answer' and t.reward == len(task.golds)
        assert [tr['train'] for tr in t.turns].count(False) == 1
    assert am.sum() == sum(len(tr['response']) for t in trajs for tr in t.turns if tr['train'])
