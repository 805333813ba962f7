"""Invariants of DESIGN.md on the token level: masks, owners, sampled log-probs, folding, truncation."""
import random

import pytest
import torch

from gym import OWNER, build_tokenizer, word_format
from gyms import memory as gm
from model import TinyAgent, sequence_log_probs
import advantage
import rollout
from advantage import answer_pieces, memory_rewards, scored_turn
from model import generate
from rollout import collate, context_of, rollout_batch

CFG = dict(max_turns=8, max_len=256, max_response_tokens=24, keep_tool_results=1, temperature=1.0, device='cpu',
           max_tokens_per_microbatch=16384)


class CountEnv:
    """A toy tool env: every call is answered `ok <n>`; `<call> submit </call>` ends with reward 1."""
    def reset(self, task):
        self.n = 0
        return f'task {task}'

    def step(self, action, finish='stop'):
        self.n += 1
        if action.split()[1:2] == ['submit']:
            return '', 1.0, True, dict(stop='submit', success=True)
        return f'ok {self.n}', 0.0, False, {}


def count_tok():
    return build_tokenizer(['task ok submit read'] + [str(i) for i in range(20)])


@pytest.fixture(scope='module')
def mem_setup():
    tok = build_tokenizer(gm.memory_texts())
    torch.manual_seed(0)
    model = TinyAgent(tok.vocab_size, 2, 4, 64, 256).eval()
    return tok, model, word_format(tok, memory=True)


def sampled(model, fmt, envs, tasks, cfg, seed=0):
    return rollout_batch(model, fmt, envs, tasks, cfg, generator=torch.Generator().manual_seed(seed))


def test_action_mask_is_policy_owner_shifted_and_includes_sampled_stop_token():
    tok = count_tok()
    fmt = word_format(tok)
    torch.manual_seed(1)
    model = TinyAgent(tok.vocab_size, 1, 2, 32, 128).eval()
    cfg = dict(CFG, keep_tool_results='all', max_response_tokens=4, max_turns=6)
    trajs = sampled(model, fmt, [CountEnv() for _ in range(16)], list(range(16)), cfg)
    stops = 0
    for t in trajs:
        assert t.action_mask.shape == (len(t.ids) - 1,)
        assert torch.equal(t.action_mask.bool(), t.owner[1:] == OWNER['policy'])
        for turn in t.turns:  # a sampled stop token is the last token of its turn and a policy token
            if tok.call_end_id in turn['response']:
                assert turn['response'][-1] == tok.call_end_id
                stops += 1
        pol = t.ids[1:][t.action_mask.bool()].tolist()
        assert pol == [i for turn in t.turns for i in turn['response']]  # the sampled ids, nothing re-encoded
        tool_or_template = t.owner[1:] != OWNER['policy']
        assert t.action_mask[tool_or_template].sum() == 0
    assert stops > 0


def test_logp_gap_batched_kv_rollout_full_history_and_folded(mem_setup):
    tok, model, fmt = mem_setup
    tasks = gm.make_tasks('train', 12, seed=3)
    for keep in ('all', 1):
        cfg = dict(CFG, keep_tool_results=keep)
        trajs = sampled(model, fmt, [gm.MemoryEnv() for _ in tasks], tasks, cfg, seed=4)
        b = collate(trajs, tok.pad_id)
        with torch.no_grad():
            logp = sequence_log_probs(model, b['ids'], b['attention_mask'])
        gap = ((logp - b['sample_logp']).abs() * b['action_mask']).max()
        assert b['action_mask'].sum() > 100 and gap <= 1e-5
        if keep == 'all':  # prefix-stable: one row per episode, identical to the full sequence ...
            for t in trajs:
                n = len(t.rows[0]['ids'])
                assert len(t.rows) == 1 and torch.equal(t.rows[0]['ids'], t.ids[:n])
                # ... up to the last observation of a truncated episode: no turn was sampled after it
                assert n == len(t.ids) or (t.info['stop'] in ('max_len', 'max_turns') and (t.owner[n:] != OWNER['policy']).all())
        else:  # folded: one row per turn
            assert all(len(t.rows) == len(t.turns) for t in trajs)


def test_kv_reuse_with_the_tiny_model(mem_setup):
    """The TinyAgent's list cache through kv_reuse: greedy and sampled (same generator seed), the same
    ids and log-probs (1e-5) as re-prefilling every turn (a 100-word vocabulary: float rounding does
    not move a draw here, unlike test_real_models' flat 152k-token one); the stored log-probs are the
    trainer's (1e-5)."""
    tok, model, fmt = mem_setup
    tasks = gm.make_tasks('train', 12, seed=3)
    for keep, temperature in [('all', 0.0), (1, 0.0), ('all', 1.0), (1, 1.0)]:
        plain, reused = [rollout_batch(model, fmt, [gm.MemoryEnv() for _ in tasks], tasks, dict(CFG, keep_tool_results=keep, kv_reuse=r),
                                       generator=torch.Generator().manual_seed(0), temperature=temperature) for r in (False, True)]
        assert max(len(t.turns) for t in plain) >= 3
        for a, b in zip(plain, reused):
            assert a.ids.tolist() == b.ids.tolist() and (a.sample_logp - b.sample_logp).abs().max() <= 1e-5
        trajs = reused
        b = collate(trajs, tok.pad_id)
        with torch.no_grad():
            logp = sequence_log_probs(model, b['ids'], b['attention_mask'])
        assert ((logp - b['sample_logp']).abs() * b['action_mask']).max() <= 1e-5


def test_generate_temperature_logp_is_the_tempered_distribution():
    tok = count_tok()
    torch.manual_seed(2)
    model = TinyAgent(tok.vocab_size, 1, 2, 32, 64).eval()
    ctx = [[tok.bos_id, 5, 6, 7], [tok.bos_id, 8]]
    resp, lps = generate(model, ctx, [tok.call_end_id], 5, temperature=0.7, generator=torch.Generator().manual_seed(0))
    for c, r, lp in zip(ctx, resp, lps):
        ids = torch.tensor([c + r])
        with torch.no_grad():
            ref = sequence_log_probs(model, ids, temperature=0.7)[0, len(c) - 1:]
        assert torch.allclose(ref, torch.tensor(lp), atol=1e-5)
        with torch.no_grad():
            untempered = sequence_log_probs(model, ids)[0, len(c) - 1:]
        assert (untempered - torch.tensor(lp)).abs().max() > 1e-3  # temperature really changes the log-probs


def test_full_history_row_of_a_folded_episode_is_the_row_full_history_builds(mem_setup):
    """warmstart_full: the extra row of a folded scripted episode is exactly the single row the same
    turns build with keep_tool_results='all'; a scripted mistake (train=False) stays out of its mask,
    and max_len cuts it to a prefix."""
    _, _, fmt = mem_setup
    tasks = gm.make_tasks('train', 3, seed=5, n_objectives=(2, 2), hops=(3, 3))
    def play(keep):  # the detour draws from its own seed, so both renderings make the same mistake
        policies = [gm.folded_policy(gm.with_detour(random.Random(i), 1.0, gm.oracle_policy)) for i in range(3)]
        return rollout_batch(policies, fmt, [gm.MemoryEnv() for _ in tasks], tasks, dict(CFG, keep_tool_results=keep))
    for folded, full in zip(play(1), play('all')):
        assert len(folded.rows) == len(folded.turns) > 1 and len(full.rows) == 1
        assert [u['train'] for u in folded.turns].count(False) == 1  # the detour
        row, want = rollout.full_history_row(folded, 10_000), full.rows[0]
        for key in ('ids', 'action_mask', 'turn_ids', 'mem_mask'):
            assert torch.equal(row[key], want[key]), key
        wrong = [k for k, u in enumerate(folded.turns) if not u['train']][0]
        assert (row['action_mask'][row['turn_ids'] == wrong] == 0).all()
        assert row['action_mask'].sum() == sum(len(u['response']) for u in folded.turns if u['train'])
        cut = rollout.full_history_row(folded, 40)
        assert len(cut['ids']) == 40 and all(len(cut[k]) == 39 for k in ('action_mask', 'sample_logp', 'turn_ids', 'mem_mask'))
        assert torch.equal(cut['action_mask'], row['action_mask'][:39])


def test_turn3_context_is_prompt_last_mem_last_obs_prefix(mem_setup):
    tok, _, fmt = mem_setup
    task = gm.make_tasks('train', 1, seed=5, n_objectives=(1, 1), hops=(3, 3))[0]
    t = rollout_batch([gm.folded_policy(gm.oracle_policy)], fmt, [gm.MemoryEnv()], [task], CFG)[0]
    assert len(t.turns) >= 3
    resp2 = t.turns[1]['response']
    mem2 = resp2[:resp2.index(tok.stoi['</mem>']) + 1]  # turn 2's memory as sampled, through </mem>
    query = t.info['actions'][1].split('<search>')[1].split('</search>')[0].strip()
    obs2 = f'{query} {task.facts[query]}'  # what the env answered to turn 2, computed independently
    mem_id = tok.stoi['<mem>']
    expected = ([tok.bos_id] + tok.encode(task.question) + [mem_id] + mem2
                + [tok.obs_id] + tok.encode(obs2) + [tok.obs_end_id] + [mem_id])
    assert t.turns[2]['context'][0] == expected
    # turn 1's memory and observation are gone from the context, but still in the full history
    assert len(t.turns[2]['context'][0]) < int((t.turn == 2).nonzero()[0]) + 1


def test_truncation_by_turns_and_context_gives_reward_0():
    tok = count_tok()
    fmt = word_format(tok)
    never_submit = [lambda ep: '<call> read </call>'] * 3
    t = rollout_batch(never_submit, fmt, [CountEnv() for _ in range(3)], [0, 1, 2], dict(CFG, keep_tool_results='all', max_turns=3))
    assert all(x.info['stop'] == 'max_turns' and x.reward == 0 and len(x.turns) == 3 for x in t)
    t = rollout_batch(never_submit, fmt, [CountEnv() for _ in range(3)], [0, 1, 2],
                      dict(CFG, keep_tool_results='all', max_turns=50, max_len=40, max_response_tokens=4))
    assert all(x.info['stop'] == 'max_len' and x.reward == 0 and len(x.ids) <= 40 for x in t)
    submit_late = [lambda ep: '<call> submit </call>' if len(ep.turns) == 2 else '<call> read </call>']
    t = rollout_batch(submit_late, fmt, [CountEnv()], [0], dict(CFG, keep_tool_results='all'))
    assert t[0].reward == 1.0 and t[0].info['stop'] == 'submit'


def test_env_that_raises_or_nan_reward_marks_episode_invalid():
    class Broken(CountEnv):
        def step(self, action, finish='stop'):
            raise RuntimeError('tool crashed')

    class NaNReward(CountEnv):
        def step(self, action, finish='stop'):
            return '', float('nan'), True, dict(stop='submit', success=False)
    tok = count_tok()
    pol = [lambda ep: '<call> read </call>'] * 2
    t = rollout_batch(pol, word_format(tok), [Broken(), NaNReward()], [0, 1], dict(CFG, keep_tool_results='all'))
    assert [x.valid for x in t] == [False, False] and all(x.reward == 0.0 for x in t)
    assert 'tool crashed' in t[0].info['error']


def test_memory_reward_scores_answer_tokens_only_in_the_two_contexts(mem_setup):
    tok, model, fmt = mem_setup
    task = gm.make_tasks('train', 1, seed=7, n_objectives=(1, 1), hops=(2, 2))[0]
    t = rollout_batch([gm.folded_policy(gm.oracle_policy)], fmt, [gm.MemoryEnv()], [task], CFG)[0]
    gold = gm.answer_text(task)
    mem_r, valid = memory_rewards(model, [t], fmt, [gold], CFG)
    assert not valid[0, 0] and valid[0, 1:len(t.turns)].all()
    ans, amask = answer_pieces(fmt, gold)
    assert amask[0] == 0 and amask[-1] == 0 and sum(amask) == len(ans) - 2  # tags not scored
    k = 1
    resp = t.turns[k]['response']
    mem = [tok.stoi['<mem>']] + resp[:t.turns[k]['mem_len']]
    full = t.ids.tolist()[:t.turn.tolist().index(k)] + mem
    short = t.ids.tolist()[:t.prompt_len] + mem

    def p(ctx):
        with torch.no_grad():
            lp = sequence_log_probs(model, torch.tensor([ctx + ans]))[0]
        cols = [len(ctx) - 1 + i for i, m in enumerate(amask) if m]
        return torch.exp(lp[cols].mean())
    assert torch.allclose(mem_r[0, k], p(short) - p(full), atol=1e-5)


def one_at_a_time_answer_probs(model, trajs, fmt, answers, cfg):
    """{(n, k): (P_mem, P_full)} of every valid turn, each from a plain, unpadded, uncached forward."""
    def p(ctx, ans, amask):
        with torch.no_grad():
            lp = sequence_log_probs(model, torch.tensor([ctx + ans]))[0]
        return float(torch.exp(lp[[len(ctx) - 1 + i for i, m in enumerate(amask) if m]].mean()))
    out = {}
    for n, t in enumerate(trajs):
        ans, amask = answer_pieces(fmt, answers[n])
        for k in range(1, len(t.turns)):
            if scored_turn(t.turns[k]):  # as the gym judged it
                mem = fmt.turn_prefix + t.turns[k]['response'][:t.turns[k]['mem_len']]
                full = t.ids.tolist()[:t.turn.tolist().index(k)] + mem
                if len(full) + len(ans) <= cfg['max_len']:
                    out[n, k] = p(t.ids.tolist()[:t.prompt_len] + mem, ans, amask), p(full, ans, amask)
    return out


@pytest.mark.parametrize('budget', [16384, 300])  # 300: a history or two per micro-batch
def test_memory_rewards_on_shared_histories_equal_one_forward_per_turn(mem_setup, budget, monkeypatch):
    # one history forward per episode (KV cache) gives each turn's P_full as its own forward would
    tok, _, fmt = mem_setup
    torch.manual_seed(0)
    model = TinyAgent(tok.vocab_size, 2, 4, 64, 256).eval()
    with torch.no_grad():  # larger weights: peaked attention, answer probabilities further apart
        for w in model.parameters():
            w.mul_(2.0)
    tasks = gm.make_tasks('train', 6, seed=3, n_objectives=(1, 3), hops=(1, 3))
    cfg = dict(CFG, max_tokens_per_microbatch=budget, max_turns=12)
    trajs = sampled(model, fmt, [gm.MemoryEnv() for _ in tasks], tasks, cfg)
    trajs += rollout_batch([gm.folded_policy(gm.oracle_policy)] * 6, fmt, [gm.MemoryEnv() for _ in range(6)], tasks, cfg)
    answers = [gm.answer_text(t.task) for t in trajs]
    got = {}
    for name in ('answer_probs', 'full_answer_probs'):  # record what memory_rewards computed, in log space
        def spy(*args, _f=getattr(advantage, name), _name=name, **kw):
            got[_name] = out = _f(*args, **kw)
            return out
        monkeypatch.setattr(advantage, name, spy)
    mem_r, valid = memory_rewards(model, trajs, fmt, answers, cfg)
    want = one_at_a_time_answer_probs(model, trajs, fmt, answers, cfg)
    assert len(want) >= 12 and len({len(t.ids) for t in trajs}) > 5  # many turns, histories of many lengths
    assert [tuple(x) for x in valid.nonzero().tolist()] == sorted(want)
    assert max(abs(float(mem_r[n, k]) - (pm - pf)) for (n, k), (pm, pf) in want.items()) <= 1e-6
    order = sorted(want, key=lambda nk: nk)  # memory_rewards lists turns episode by episode
    log_mem = torch.log(torch.tensor([want[nk][0] for nk in order], dtype=torch.float64))
    log_full = torch.log(torch.tensor([want[nk][1] for nk in order], dtype=torch.float64))
    assert torch.allclose(torch.log(got['answer_probs'].double()), log_mem, atol=1e-5, rtol=0)
    assert torch.allclose(torch.log(got['full_answer_probs'].double()), log_full, atol=1e-5, rtol=0)
    assert float(log_full.max() - log_full.min()) > 1.0  # the values differ: a mix-up of rows would show


class FinishEnv(CountEnv):
    """CountEnv that records the finish reason the rollout hands to every step."""
    def reset(self, task):
        self.finishes = []
        return super().reset(task)

    def step(self, action, finish='stop'):
        self.finishes.append(finish)
        return super().step(action)


def test_finish_reason_of_sampled_and_scripted_turns_reaches_the_env():
    # a turn without its stop token (cut at max_response_tokens) must reach the env as 'length'
    tok = count_tok()
    fmt = word_format(tok)
    torch.manual_seed(1)
    model = TinyAgent(tok.vocab_size, 1, 2, 32, 128).eval()
    envs = [FinishEnv() for _ in range(16)]
    trajs = sampled(model, fmt, envs, list(range(16)), dict(CFG, keep_tool_results='all', max_response_tokens=4, max_turns=6))
    got = [(f, tr['finish']) for t, e in zip(trajs, envs) for f, tr in zip(e.finishes, t.turns)]
    want = [('stop' if tr['response'][-1] == tok.call_end_id else 'length',) * 2 for t in trajs for tr in t.turns]
    assert got == want and {f for f, _ in got} == {'stop', 'length'}
    # scripted texts: cut (even right after a stop id) or not ending with a stop id -> 'length'
    texts = {'<call> read </call>': 'stop', '<call> read': 'length', '<call> read </call> ok': 'length',
             '<call> read </call> <call> submit </call>': 'length', '': 'length'}
    envs = [FinishEnv() for _ in texts]
    rollout_batch([lambda ep, s=s: s for s in texts], fmt, envs, list(range(len(texts))),
                  dict(CFG, keep_tool_results='all', max_response_tokens=3, max_turns=1))
    assert [e.finishes for e in envs] == [[f] for f in texts.values()]


def test_prompts_that_leave_no_room_for_a_turn_fail_at_setup():
    # `task N` is 3 tokens with <bos>; a turn needs max_response_tokens more
    from gym import check_prompts_fit
    gym_ = dict(fmt=word_format(count_tok()), make_env=CountEnv, train_tasks=[0, 7], eval_tasks=[12])
    assert check_prompts_fit(gym_, dict(max_len=10, max_response_tokens=7)) == 3
    with pytest.raises(ValueError, match='max_len=10 is too short: the longest prompt is 3 tokens and a '
                                         'turn needs max_response_tokens=8 more'):
        check_prompts_fit(gym_, dict(max_len=10, max_response_tokens=8))
    task = gm.make_tasks('train', 1)[0]  # the memory gym's forced <mem> counts too
    gym_ = dict(fmt=word_format(build_tokenizer(gm.memory_texts()), memory=True), make_env=gm.MemoryEnv,
                train_tasks=[], eval_tasks=[task])
    n = 1 + len(task.question.split()) + 1
    assert check_prompts_fit(gym_, dict(max_len=n + 24, max_response_tokens=24)) == n


def hand_row(ids, action, logp):
    n = len(ids) - 1
    return dict(ids=torch.tensor(ids), owner=torch.zeros(len(ids), dtype=torch.long), action_mask=torch.tensor(action, dtype=torch.float32),
                sample_logp=torch.tensor(logp), turn_ids=torch.arange(n), mem_mask=torch.zeros(n))


def test_pack_rows_keeps_the_shared_prefix_once_and_every_target_once():
    """Two folded rows sharing [1, 2, 3]: the shared part is [1, 2] (the common prefix less its last
    token), each segment starts with 3; the shared target (row 1's policy token 3) comes from the row
    that trains it; a segment's last position predicts nothing. A target two rows train stays in both."""
    r1 = hand_row([1, 2, 3, 7, 8], [0, 1, 1, 1], [0, -.1, -.2, -.3])
    r2 = hand_row([1, 2, 3, 9, 10, 11], [0, 0, 0, 1, 1], [0, 0, 0, -.4, -.5])
    (p,) = rollout.pack_rows([r1, r2])
    assert p['ids'].tolist() == [1, 2, 3, 7, 8, 3, 9, 10, 11] and p['segments'].tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert p['action_mask'].tolist() == [0, 1, 1, 1, 0, 0, 1, 1]
    assert p['sample_logp'].tolist() == pytest.approx([0, -.1, -.2, -.3, 0, 0, -.4, -.5])
    assert p['turn_ids'].tolist() == [0, 1, 2, 3, -1, 2, 3, 4]
    r2['action_mask'][1] = 1  # both rows train token 3: the shared part stops before it
    (p,) = rollout.pack_rows([r1, r2])
    assert p['ids'].tolist() == [1, 2, 3, 7, 8, 2, 3, 9, 10, 11] and p['segments'].tolist() == [0] + [1] * 4 + [2] * 5
    assert p['action_mask'].sum() == r1['action_mask'].sum() + r2['action_mask'].sum() == 6
    assert rollout.pack_rows([r1]) == [r1]
    assert rollout.pack_rows([r1, hand_row([5, 2, 3], [0, 1], [0, -1])])[0] is r1  # nothing shared: unchanged


@pytest.mark.parametrize('kind', ['tiny', 'qwen3'])
def test_packed_rows_score_what_their_rows_score(mem_setup, kind):
    """pack_turns: an episode's folded rows packed into one row (half the tokens here) give every policy
    token the log-prob it has in its own row (float32, 1e-5), for the TinyAgent and a Hugging Face model
    (a 4D attention mask); sampled log-probs, turns and memory masks are the same entries in order."""
    tok, model, fmt = mem_setup
    if kind == 'qwen3':
        from transformers import Qwen3Config, Qwen3ForCausalLM
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=tok.vocab_size + 8, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             pad_token_id=0, bos_token_id=None, eos_token_id=None)).eval()
    tasks = gm.make_tasks('train', 12, seed=3)
    trajs = sampled(mem_setup[1], fmt, [gm.MemoryEnv() for _ in tasks], tasks, CFG)
    plain, packed = collate(trajs, tok.pad_id), collate(trajs, tok.pad_id, pack=True)
    assert len(packed['ids']) == len(trajs) < len(plain['ids'])
    assert packed['attention_mask'].sum() < 0.7 * plain['attention_mask'].sum()

    def per_episode(b, x):  # an episode's trained entries, row after row
        return [x[(b['row_episode'] == n)][b['action_mask'][b['row_episode'] == n].bool()] for n in range(len(trajs))]
    with torch.no_grad():
        logps = [sequence_log_probs(model, b['ids'], b['attention_mask'], segments=b['segments']) for b in (plain, packed)]
    for a, b in zip(per_episode(plain, logps[0]), per_episode(packed, logps[1])):
        assert len(a) == len(b) > 0 and (a - b).abs().max() <= 1e-5
    for key in ('sample_logp', 'turn_ids', 'mem_mask'):
        assert all(torch.equal(a, b) for a, b in zip(per_episode(plain, plain[key]), per_episode(packed, packed[key])))
