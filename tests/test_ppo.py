"""The PPO update: ratio 1 before the first step, exact normalisation across micro-batches, losses."""
import copy
import random

import torch

import gym_memory as gm
from advantage import grpo_advantage, token_advantages
from gym import build_tokenizer
from model import TinyAgent
from rollout import collate, rollout_batch, word_format
from train import config, kl_penalty, loss_weights, micro_batches, ppo_update


def setup(keep=1, n=8, group=4, seed=0):
    tok = build_tokenizer(gm.memory_texts())
    torch.manual_seed(seed)
    model = TinyAgent(tok.vocab_size, 2, 4, 64, 256)
    tasks = gm.make_tasks('train', n // group, seed=seed)
    tasks = [t for t in tasks for _ in range(group)]
    cfg = dict(config, keep_tool_results=keep, max_turns=6, max_response_tokens=16, max_len=256)
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


def grads_after(model, batch, adv, cfg, budget, loss_agg):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves weights, we read gradients
    ppo_update(model, opt, batch, adv, None, dict(cfg, mini_batches=1, max_tokens_per_microbatch=budget,
                                                  loss_agg=loss_agg, grad_clip=1e9), random.Random(0))
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


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
    w = loss_weights(mask, rows, 'token-mean', 2, 10)
    assert torch.allclose(w, mask / 7)
    w = loss_weights(mask, rows, 'seq-mean', 2, 10)
    assert torch.allclose(w[0], mask[0] / (2 * 2)) and torch.allclose(w[1:], mask[1:] / (5 * 2))
    assert torch.allclose(w.sum(), torch.tensor(1.0))  # each episode weighs 1/2
    w = loss_weights(mask, rows, 'drgrpo', 2, 10)
    assert torch.allclose(w, mask / 20)


def test_kl_estimators_sign_and_values():
    logp, ref = torch.tensor([-1.0, -2.0, -50.0]), torch.tensor([-1.5, -1.0, 0.0])
    lr = logp - ref
    assert torch.allclose(kl_penalty(logp, ref, 'k1'), lr.clamp(-20, 20))
    assert torch.allclose(kl_penalty(logp, ref, 'k2'), 0.5 * lr.clamp(-20, 20) ** 2)
    k3 = kl_penalty(logp, ref, 'k3')
    assert torch.isfinite(k3).all() and (k3 >= 0).all()  # clamped: exp(50) would overflow float32
    assert torch.allclose(k3[:2], torch.exp(-lr[:2]) + lr[:2] - 1)
    assert kl_penalty(ref, ref, 'k3').abs().max() == 0


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
