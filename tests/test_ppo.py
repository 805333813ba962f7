"""The PPO update: ratio 1 before the first step, exact normalisation across micro-batches, losses."""
import copy
import math
import random

import pytest
import torch

from advantage import grpo_advantage, token_advantages
from gym import build_tokenizer, word_format
from gyms import memory as gm
from model import TinyAgent
from rollout import collate, rollout_batch
import train
from train import config, kl_penalty, loss_weights, micro_batches, policy_loss, ppo_update


def setup(keep=1, n=8, group=4, seed=0, dtype='float32'):
    tok = build_tokenizer(gm.memory_texts())
    torch.manual_seed(seed)
    model = TinyAgent(tok.vocab_size, 2, 4, 64, 256)
    tasks = gm.make_tasks('train', n // group, seed=seed)
    tasks = [t for t in tasks for _ in range(group)]
    cfg = dict(config, keep_tool_results=keep, max_turns=6, max_response_tokens=16, max_len=256, dtype=dtype)
    model.eval()
    trajs = rollout_batch(model, word_format(tok, memory=True), [gm.MemoryEnv() for _ in tasks], tasks, cfg,
                          groups=[i // group for i in range(n)], generator=torch.Generator().manual_seed(seed))
    batch = collate(trajs, tok.pad_id)
    # rewards of an untrained policy are all 0: give the groups some spread so advantages are not 0
    batch['rewards'] = torch.tensor([float(i % 3 == 0) for i in range(n)])
    out = grpo_advantage(batch['rewards'], batch['group_ids'])
    adv = token_advantages(out, batch['row_episode'], batch['action_mask'])
    return model, batch, adv, cfg


def test_ratio_is_one_on_first_minibatch_before_any_step():
    model, batch, adv, cfg = setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = ppo_update(model, opt, batch, adv, None, dict(cfg, mini_batches=2), random.Random(0))
    assert m['ratio_dev_first_minibatch'] <= 1e-5 and m['logp_gap_max'] <= 1e-5
    assert m['grad_norm'] > 0


def grads_after(model, batch, adv, cfg, budget, loss_agg, grad_clip=1e9):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves weights, we read gradients
    ppo_update(model, opt, batch, adv, None, dict(cfg, mini_batches=1, max_tokens_per_microbatch=budget,
                                                  loss_agg=loss_agg, grad_clip=grad_clip), random.Random(0))
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def test_skipping_rows_without_advantage_leaves_the_gradient_and_computes_fewer_rows(monkeypatch):
    """skip_zero_advantage: rows whose advantages are all 0 are not forwarded, yet stay in the
    normaliser, so every aggregation's gradient is the one of the full update; a KL term keeps them."""
    model, batch, adv, cfg = setup(keep=1, n=8)
    batch['rewards'] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # group 1: all equal, no signal
    adv = token_advantages(grpo_advantage(batch['rewards'], batch['group_ids']), batch['row_episode'], batch['action_mask'])
    signal_rows = int(((adv != 0) & batch['action_mask'].bool()).any(1).sum())
    assert 0 < signal_rows < len(adv)
    forwarded = []
    real = train.sequence_log_probs
    monkeypatch.setattr(train, 'sequence_log_probs', lambda m, ids, *a, **k: forwarded.append(len(ids)) or real(m, ids, *a, **k))
    for agg in ('token-mean', 'seq-mean', 'drgrpo'):
        forwarded.clear()
        whole = grads_after(model, batch, adv, cfg, budget=10 ** 9, loss_agg=agg)
        assert sum(forwarded) == len(adv)
        forwarded.clear()
        skipped = grads_after(model, batch, adv, dict(cfg, skip_zero_advantage=True), budget=10 ** 9, loss_agg=agg)
        assert sum(forwarded) == signal_rows
        assert whole.norm() > 0 and (whole - skipped).norm() / whole.norm() <= 1e-6, agg
    forwarded.clear()  # with a KL term every row has a gradient: none is skipped
    ppo_update(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0), batch, adv, batch['sample_logp'] - 0.1,
               dict(cfg, mini_batches=1, kl_coef=0.1, skip_zero_advantage=True), random.Random(0))
    assert sum(forwarded) == len(adv)


def test_minibatch_gradient_does_not_depend_on_microbatch_split():
    model, batch, adv, cfg = setup(keep=1, n=8)
    L = batch['ids'].shape[1]
    for agg in ('token-mean', 'seq-mean', 'drgrpo'):
        whole = grads_after(model, batch, adv, cfg, budget=10 ** 9, loss_agg=agg)
        split = grads_after(model, batch, adv, cfg, budget=2 * L, loss_agg=agg)  # many micro-batches
        assert len(micro_batches(batch['attention_mask'].sum(1).tolist(), 2 * L)) > 3
        rel = (whole - split).norm() / whole.norm()
        assert whole.norm() > 0 and rel <= 1e-6, (agg, float(rel))


def test_loss_weights_hand_computed():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0.0]])
    rows = torch.tensor([0, 1, 1])  # episode 1 has two rows (folded turns): 5 policy tokens
    w = loss_weights(mask, rows, 'token-mean', 10)
    assert torch.allclose(w, mask / 7)
    w = loss_weights(mask, rows, 'seq-mean', 10)
    assert torch.allclose(w[0], mask[0] / (2 * 2)) and torch.allclose(w[1:], mask[1:] / (5 * 2))
    assert torch.allclose(w.sum(), torch.tensor(1.0))  # each episode weighs 1/2
    w = loss_weights(mask, rows, 'drgrpo', 10)
    assert torch.allclose(w, mask / 20)


def test_kl_estimators_sign_and_values():
    logp, ref = torch.tensor([-1.0, -2.0, -50.0]), torch.tensor([-1.5, -1.0, 0.0])
    lr = logp - ref
    assert torch.allclose(kl_penalty(logp, ref, 'k1'), lr.clamp(-10, 10))
    assert torch.allclose(kl_penalty(logp, ref, 'k2'), (0.5 * lr ** 2).clamp(max=10))
    k3 = kl_penalty(logp, ref, 'k3')
    assert torch.isfinite(k3).all() and (k3 >= 0).all()  # clamped: exp(50) would overflow float32
    assert torch.allclose(k3[:2], torch.exp(-lr[:2]) + lr[:2] - 1)
    assert kl_penalty(ref, ref, 'k3').abs().max() == 0


def test_grad_clip_zero_means_no_clipping():
    """grad_clip: 0 leaves the gradient as it is (torch's clip_grad_norm_ with max_norm 0 would zero it)."""
    model, batch, adv, cfg = setup(keep=1, n=8)
    unclipped = grads_after(model, batch, adv, cfg, 10 ** 9, 'token-mean')
    assert unclipped.norm() > 1e-3
    assert torch.equal(grads_after(model, batch, adv, cfg, 10 ** 9, 'token-mean', grad_clip=0), unclipped)
    clipped = grads_after(model, batch, adv, cfg, 10 ** 9, 'token-mean', grad_clip=1e-3)
    assert torch.allclose(clipped.norm(), torch.tensor(1e-3), rtol=1e-3)


def test_invalid_episodes_get_zero_weight():
    model, batch, adv, cfg = setup(keep='all', n=8)
    batch['valid'][:4] = False
    g1 = grads_after(model, batch, adv, cfg, 10 ** 9, 'token-mean')
    adv2 = adv.clone()
    adv2[batch['row_episode'] < 4] = 123.0  # anything on invalid episodes must not matter
    g2 = grads_after(model, batch, adv2, cfg, 10 ** 9, 'token-mean')
    assert torch.allclose(g1, g2)


def test_non_finite_loss_skips_the_optimizer_step():
    model, batch, adv, cfg = setup(keep='all', n=8)
    before = [p.detach().clone() for p in model.parameters()]
    batch['sample_logp'][0, :] = float('nan')  # poisons the loss of the mini-batch holding episode 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = ppo_update(model, opt, batch, adv, None, dict(cfg, mini_batches=1), random.Random(0))
    assert m['bad_steps'] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing reached the weights


def test_aggregations_count_only_episodes_with_trained_tokens():
    """Two sequences with per-token losses [1, 3] and [5, 7], the second fully masked (invalid):
    every aggregation divides by what it trains. seq-mean = 2.0 (it was 1.0: the invalid sequence
    was counted), token-mean = 2.0, drgrpo = (1 + 3) / (max_episode_tokens 4 x 1 episode) = 1.0."""
    losses = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    rows = torch.tensor([0, 1])
    assert float((losses * loss_weights(mask, rows, 'seq-mean', 4)).sum()) == 2.0
    assert float((losses * loss_weights(mask, rows, 'token-mean', 4)).sum()) == 2.0
    assert float((losses * loss_weights(mask, rows, 'drgrpo', 4)).sum()) == 1.0
    for agg in ('seq-mean', 'token-mean', 'drgrpo'):  # nothing trained: weights 0, no division by 0
        assert torch.equal(loss_weights(torch.zeros(2, 2), rows, agg, 4), torch.zeros(2, 2))


@pytest.mark.parametrize('kl_type', ['k1', 'k2', 'k3'])
def test_kl_estimate_and_its_gradient_are_bounded(kl_type):
    """kl_penalty at log-ratios -30, -10, 0, 10, 30: the value is bounded by KL_MAX = 10 and no token's
    gradient exceeds 12.6 (k3's gradient at -10 was -2.2e4, near -20 -4.9e8, before the bound)."""
    log_ratio = torch.tensor([-30.0, -10.0, 0.0, 10.0, 30.0])
    logp = log_ratio.clone().requires_grad_(True)
    kl = kl_penalty(logp, torch.zeros(5), kl_type)
    kl.sum().backward()
    exact = {'k1': log_ratio, 'k2': 0.5 * log_ratio ** 2, 'k3': torch.exp(-log_ratio) + log_ratio - 1}[kl_type]
    assert torch.allclose(kl.detach(), exact.clamp(-10, 10))
    assert logp.grad.abs().max() <= 12.6
    if kl_type == 'k3':
        assert kl.detach().tolist()[:3] == [10.0, 10.0, 0.0] and kl[4] == 10
        assert abs(float(kl.detach()[3]) - (math.exp(-10) + 9)) < 1e-5
        assert logp.grad.tolist()[:3] == [0.0, 0.0, 0.0] and logp.grad[4] == 0
        assert abs(float(logp.grad[3]) - (1 - math.exp(-10))) < 1e-6
    grid = torch.linspace(-40, 40, 8001, requires_grad=True)  # the bound holds everywhere, not only at 5 points
    kl_penalty(grid, torch.zeros(8001), kl_type).sum().backward()
    assert grid.grad.abs().max() <= 12.6


@pytest.mark.parametrize('a', [0.0, 1.0, -1.0])
def test_one_bad_old_logprob_costs_nothing(a):
    """sample_logp = -100 on one policy token (its current log-prob about -2): the log-ratio is
    clamped before exp, so the loss stays finite, that token has zero gradient, no step is skipped
    (it was bad_steps 1), and the update equals the clean batch's, where that token has its true
    old log-prob and advantage 0."""
    model, batch, adv, cfg = setup(keep='all', n=8)
    r, j = [int(x) for x in torch.nonzero(batch['action_mask'])[0]]
    clean_adv, bad_adv = adv.clone(), adv.clone()
    clean_adv[r, j], bad_adv[r, j] = 0.0, a
    bad = dict(batch, sample_logp=batch['sample_logp'].clone())
    bad['sample_logp'][r, j] = -100.0
    g_clean = grads_after(model, batch, clean_adv, cfg, 10 ** 9, 'token-mean')
    g_bad = grads_after(model, bad, bad_adv, cfg, 10 ** 9, 'token-mean')
    assert torch.isfinite(g_bad).all() and torch.allclose(g_bad, g_clean, atol=1e-7)
    m_model = copy.deepcopy(model)
    m = ppo_update(m_model, torch.optim.AdamW(m_model.parameters(), lr=1e-2), bad, bad_adv, None,
                   dict(cfg, mini_batches=1), random.Random(0))
    assert m['bad_steps'] == 0 and m['log_ratio_clamped'] == 1 and math.isfinite(m['loss'])


def test_policy_loss_hand_computed():
    """Two tokens: ratio e^0.5 with advantage +1 is clipped at 1.28, ratio e^-0.5 with advantage -1
    at 0.8; token-mean weights 1/2; kl_coef 0.1 with k1 against a reference 0.25 below."""
    cfg = dict(config, clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_type='k1')
    old = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[-0.5, -1.5]], requires_grad=True)
    advantages, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    loss, st = policy_loss(logp, old, advantages, mask, mask / 2, cfg, ref_logp=logp.detach() - 0.25)
    assert abs(float(loss.detach()) - ((-1.28 + 0.8) / 2 + 0.1 * 0.25)) < 1e-6
    assert st['clipped'].tolist() == [[True, True]] and not st['clamped'].any()


@pytest.mark.parametrize('n_valid', [1, 0])
def test_microbatch_without_trainable_tokens_adds_zero(n_valid):
    """One valid and one invalid episode with one row per micro-batch (so one micro-batch holds only
    the invalid row), and both invalid: the step goes on (it raised 'element 0 of tensors does not
    require grad'); the invalid row adds loss 0 and gradient 0."""
    model, batch, adv, cfg = setup(keep='all', n=2, group=2)
    batch['valid'][n_valid:] = False
    L = batch['ids'].shape[1]
    cfg = dict(cfg, mini_batches=1)
    g = grads_after(model, batch, adv, cfg, L, 'token-mean')  # budget L: one row per micro-batch
    if n_valid:
        first = {k: v[:1] for k, v in batch.items()}
        g1 = grads_after(model, first, adv[:1], cfg, L, 'token-mean')
        assert torch.allclose(g, g1, atol=1e-7) and g.abs().sum() > 0
    else:
        assert g.abs().sum() == 0
    m_model = copy.deepcopy(model)
    m = ppo_update(m_model, torch.optim.AdamW(m_model.parameters(), lr=1e-2), batch, adv, None,
                   dict(cfg, max_tokens_per_microbatch=L), random.Random(0))
    assert m['bad_steps'] == 0 and (n_valid or m['loss'] == 0.0)
