"""Checks that need a CUDA device (marked cuda; skipped without one). scripts/cuda_check.sh runs them
on a lent GPU; CPU CI runs the same bf16 autocast code path on the CPU (test_real_models.py)."""
import random

import pytest
import torch

import gyms.memory as gm
import train
from advantage import grpo_advantage, token_advantages
from gym import build_tokenizer, word_format
from model import TinyAgent, sequence_log_probs, tiny_qwen3
from rollout import collate, rollout_batch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')]


def memory_batch(model, tok, cfg, n=8, group=4):
    tasks = [t for t in gm.make_tasks('train', n // group, seed=0) for _ in range(group)]
    trajs = rollout_batch(model, word_format(tok, memory=True), [gm.MemoryEnv() for _ in tasks], tasks, cfg,
                          groups=[i // group for i in range(n)], generator=torch.Generator('cuda').manual_seed(0))
    batch = collate(trajs, tok.pad_id)
    batch['rewards'] = torch.tensor([float(i % 3 == 0) for i in range(n)])
    adv = token_advantages(grpo_advantage(batch['rewards'], batch['group_ids']), batch['row_episode'], batch['action_mask'])
    return batch, adv


@pytest.mark.parametrize('dtype, bound', [('float32', 1e-5), ('bfloat16', 5e-2)])
def test_sampler_and_trainer_log_probs_agree_on_cuda(dtype, bound):
    """TinyAgent on the GPU: the stored sampling log-probs equal the trainer's recomputation (float32:
    1e-5, the CPU bound; bf16 autocast: rounding only), and one PPO update is finite."""
    tok = build_tokenizer(gm.memory_texts())
    torch.manual_seed(0)
    model = TinyAgent(tok.vocab_size, 2, 4, 64, 256).cuda()
    cfg = dict(train.config, device='cuda', dtype=dtype, keep_tool_results=1, max_turns=6, max_response_tokens=16,
               max_len=256)
    batch, adv = memory_batch(model, tok, cfg)
    m = train.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, adv, None, cfg, random.Random(0))
    assert m['logp_gap_max'] <= bound and m['bad_steps'] == 0 and m['grad_norm'] > 0


def test_tiny_qwen3_bf16_update_on_cuda():
    """A tiny Qwen3 (real vocabulary size) in bf16 autocast: reference and policy log-probs come from
    the same autocast, so the KL on the first mini-batch is rounding, not a signal."""
    model = tiny_qwen3(seed=0).cuda()
    ids = torch.randint(0, 151643, (4, 48))
    batch = dict(ids=ids, attention_mask=torch.ones_like(ids), action_mask=torch.ones(4, 47),
                 sample_logp=torch.zeros(4, 47), row_episode=torch.arange(4), rewards=torch.tensor([1., 0., 1., 0.]),
                 valid=torch.ones(4, dtype=torch.bool), group_ids=torch.zeros(4, dtype=torch.long))
    cfg = dict(train.config, device='cuda', dtype='bfloat16', kl_coef=0.1)
    batch['sample_logp'] = train.reference_log_probs(model, batch, cfg)  # as if sampled by this policy
    adv = token_advantages(grpo_advantage(batch['rewards'], batch['group_ids']), batch['row_episode'], batch['action_mask'])
    ref = train.reference_log_probs(model, batch, cfg)
    m = train.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch, adv, ref,
                         dict(cfg, mini_batches=1), random.Random(0))
    assert m['bad_steps'] == 0 and m['logp_gap_max'] <= 5e-2 and m['kl'] <= 1e-3


def test_packed_rows_score_what_their_rows_score_on_cuda():
    """pack_turns on the GPU: a tiny Qwen3 (Hugging Face's default attention there, SDPA) given the
    packed rows' 4D mask scores every policy token as in its own row (float32, 1e-4); the CPU test is
    tests/test_rollout.py. A broken mask or position moves log-probs by nats, not rounding."""
    tok = build_tokenizer(gm.memory_texts())
    torch.manual_seed(0)
    sampler = TinyAgent(tok.vocab_size, 2, 4, 64, 256).cuda()
    cfg = dict(train.config, device='cuda', dtype='float32', keep_tool_results=1, max_turns=6, max_response_tokens=16,
               max_len=256)
    tasks = gm.make_tasks('train', 8, seed=3)
    trajs = rollout_batch(sampler, word_format(tok, memory=True), [gm.MemoryEnv() for _ in tasks], tasks, cfg,
                          generator=torch.Generator('cuda').manual_seed(0))
    plain, packed = collate(trajs, tok.pad_id), collate(trajs, tok.pad_id, pack=True)
    assert len(packed['ids']) == len(trajs) < len(plain['ids'])
    model = tiny_qwen3(seed=0).cuda().eval()
    with torch.no_grad():
        logps = [sequence_log_probs(model, b['ids'].cuda(), b['attention_mask'].cuda(), segments=b['segments'].cuda()).cpu()
                 for b in (plain, packed)]
    for n in range(len(trajs)):
        a, b = [x[batch['row_episode'] == n][batch['action_mask'][batch['row_episode'] == n].bool()]
                for batch, x in ((plain, logps[0]), (packed, logps[1]))]
        assert len(a) == len(b) > 0 and (a - b).abs().max() <= 1e-4
