"""Exact updates: a step without signal leaves the weights as they are; the update's log-probs are the
sampler's (dropout off), so the first mini-batch's ratio is 1."""
import copy
import random

import pytest
import torch

import train as T
from config import config, load_config
from gym import load_gym
from model import load_policy, sequence_log_probs


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def max_change(before, model):
    return max(float((a - b.detach()).abs().max()) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize('weight_decay', [0.0, 0.1])
def test_step_without_advantage_at_the_reference_leaves_the_weights(weight_decay):
    """Memory gym, one group of 4 episodes of an untrained TinyAgent (rewards all 0, so every
    advantage is 0), the reference a copy of the policy, kl_coef 0.05 (k3): the true gradient is 0,
    and no optimizer step may be taken. The weights moved by 8e-4: Adam made a full step of a
    rounding gradient (~1e-9: the reference's log-probs come from other batch shapes), after which
    the second mini-batch had a true KL gradient; with weight_decay AdamW's decay moved them too."""
    cfg = load_config(['--gym=memory', '--n_layer=2', '--n_head=4', '--n_embd=32', '--batch_size=1', '--group_size=4',
                       '--kl_coef=0.05', '--kl_type=k3', '--lr=1e-3', f'--weight_decay={weight_decay}',
                       '--max_turns=6', '--max_response_tokens=16', '--max_len=256', '--keep_tool_results=1',
                       '--train_tasks=20', '--eval_tasks=4', '--threads=1', '--device=cpu'])
    gym_ = load_gym(cfg, None, config)
    torch.manual_seed(0)
    model = load_policy(cfg, gym_['tok'].vocab_size)
    ref_model = T.reference_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg['lr'], betas=(cfg['beta1'], cfg['beta2']),
                            weight_decay=cfg['weight_decay'])
    before = weights(model)
    rng = random.Random(0)  # the stages of one step of train.main
    trajs = T.run_tasks(model, gym_, cfg, [rng.choice(gym_['train_tasks'])], 4, [0], torch.Generator().manual_seed(0))
    batch = T.collate(trajs, gym_['fmt'].pad_id)
    ref_logp = T.reference_log_probs(ref_model, batch, cfg)
    adv, _ = T.compute_advantages(model, gym_, cfg, trajs, batch, ref_logp)
    log = T.ppo_update(model, opt, batch, adv, ref_logp, cfg, rng, at_reference=T.is_reference(model, ref_model))
    assert batch['rewards'].tolist() == [0.0] * 4 and not adv.any() and batch['action_mask'].sum() > 0
    assert abs(log['kl']) <= 1e-6 and log['bad_steps'] == 0
    assert max_change(before, model) <= 1e-9 and not opt.state  # no optimizer step was taken


def test_step_with_advantage_moves_the_policy_and_then_the_kl_pulls():
    """The skip is for no signal only: with advantages every mini-batch steps; then, with advantages
    0, every mini-batch still steps, since the policy has left the reference and the KL term pulls."""
    cfg = dict(load_config(['--gym=memory', '--n_embd=32', '--batch_size=2', '--group_size=4', '--kl_coef=0.05',
                            '--train_tasks=20', '--eval_tasks=4', '--device=cpu']), ppo_epochs=2)
    gym_ = load_gym(cfg, None, config)
    torch.manual_seed(0)
    model = load_policy(cfg, gym_['tok'].vocab_size)
    ref_model = T.reference_of(model)
    trajs = T.run_tasks(model, gym_, cfg, gym_['train_tasks'][:2], 4, [0, 1], torch.Generator().manual_seed(0))
    batch = T.collate(trajs, gym_['fmt'].pad_id)
    ref_logp = T.reference_log_probs(ref_model, batch, cfg)
    adv = batch['action_mask'] * torch.tensor([1.0, -1.0] * 4)[batch['row_episode']][:, None]  # [R, T-1]
    steps = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.register_step_post_hook(lambda *a: steps.append(1))
    for a in (adv, torch.zeros_like(adv)):
        steps.clear()
        T.ppo_update(model, opt, batch, a, ref_logp, cfg, random.Random(0), at_reference=T.is_reference(model, ref_model))
        assert len(steps) == 4  # 2 epochs x 2 mini-batches
    assert not T.is_reference(model, ref_model) and T.is_reference(model, copy.deepcopy(model))


def test_warm_start_step_without_policy_tokens_leaves_the_weights(monkeypatch):
    """A warm-start batch whose episodes are all scripted mistakes (no policy token) has nothing to
    imitate: its gradient is exactly 0, yet Adam's momentum from earlier steps moved the weights."""
    cfg = load_config(['--gym=memory', '--n_embd=32', '--warmstart_episodes=4', '--warmstart_steps=8',
                       '--warmstart_batch_size=1', '--train_tasks=20', '--eval_tasks=4', '--device=cpu'])
    gym_ = load_gym(cfg, None, config)
    torch.manual_seed(0)
    model = load_policy(cfg, gym_['tok'].vocab_size)

    real_collate = T.collate

    def collate(trajs, pad_id, pack=False):  # episodes 1 and 3: every turn a mistake (action mask 0)
        b = real_collate(trajs, pad_id, pack)
        b['action_mask'][b['row_episode'] % 2 == 1] = 0
        return b
    monkeypatch.setattr(T, 'collate', collate)
    seen, real = [], T.warm_start_loss  # (policy tokens drawn, weights before the step), per step
    monkeypatch.setattr(T, 'warm_start_loss', lambda m, b, idx, c: seen.append((bool(b['action_mask'][idx].any()), weights(m)))
                        or real(m, b, idx, c))
    T.warm_start(model, gym_, cfg, random.Random(0))
    seen.append((None, weights(model)))
    empty = [i for i, (tokens, _) in enumerate(seen[:-1]) if not tokens]
    assert 0 < len(empty) < len(seen) - 1 and any(seen[i][0] for i in range(empty[-1]))  # momentum before an empty step
    for i in empty:
        assert all(torch.equal(a, b) for a, b in zip(seen[i][1], seen[i + 1][1])), i


def hf_batch(model, R=4, T_=12, seed=0):
    """A hand-made collated batch for a Hugging Face model: R rows of T_ tokens (row r right-padded by
    r tokens), the last 6 real positions policy tokens, sampled log-probs in eval mode as the sampler's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (R, T_), generator=g)
    attn = torch.ones(R, T_, dtype=torch.long)
    mask = torch.zeros(R, T_ - 1)
    for r in range(R):
        attn[r, T_ - r:] = 0
        mask[r, T_ - r - 7:T_ - r - 1] = 1
    with torch.no_grad():
        logp = sequence_log_probs(model.eval(), ids, attn) * mask  # [R, T_-1]
    return dict(ids=ids, attention_mask=attn, action_mask=mask, sample_logp=logp, rewards=torch.zeros(R),
                valid=torch.ones(R, dtype=torch.bool), row_episode=torch.arange(R))


@pytest.mark.parametrize('checkpointing', [False, True])
def test_update_log_probs_have_dropout_off(checkpointing):
    """A tiny Qwen3 with attention_dropout 0.3: the rollout samples in eval mode, so the update must
    score with dropout off too (logp_gap_max was 0.106 before any step; 9.5e-7 without dropout).
    Gradient checkpointing, which Hugging Face runs only in training mode, stays on: each micro-batch's
    attention runs twice (forward and recompute)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)  # model.tiny_qwen3's shape, a 512-token vocabulary
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         tie_word_embeddings=True, attention_dropout=0.3))
    if checkpointing:
        model.gradient_checkpointing_enable()
    batch = hf_batch(model)
    adv = batch['action_mask'] * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    cfg = dict(config, max_turns=1, max_response_tokens=12, mini_batches=2, temperature=1.0)
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    m = T.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, adv, None, cfg, random.Random(0))
    assert m['logp_gap_max'] <= 1e-5 and m['ratio_dev_first_minibatch'] <= 1e-5 and m['grad_norm'] > 0
    assert len(calls) == 2 * (2 if checkpointing else 1)  # 2 mini-batches, one micro-batch each


@pytest.mark.parametrize('loss_agg', ['token-mean', 'seq-mean'])
def test_packed_turns_take_the_same_step(loss_agg):
    """pack_turns on the folded memory gym: the warm start's loss and a PPO step (2 mini-batches, float32)
    on packed rows are those of one row per turn: losses to 1e-6, the last gradient to 1e-6 and every
    weight after two SGD steps to 1e-7 (Adam would scale the rounding of near-zero gradients up to lr),
    the first ratio 1."""
    from advantage import token_advantages
    from rollout import collate, run_tasks
    cfg = load_config(['config/tiny_mem.yaml', f'--loss_agg={loss_agg}', '--mini_batches=2'])
    gym_ = load_gym(cfg)
    torch.manual_seed(0)
    model = load_policy(cfg, gym_['tok'].vocab_size)
    trajs = run_tasks(model, gym_, cfg, gym_['train_tasks'][:8], 2, generator=torch.Generator().manual_seed(0))
    assert max(len(t.rows) for t in trajs) > 2
    outcome = torch.tensor([1.0, -1.0, 0.5, -0.5] * 4)  # [N] per episode
    results = []
    for pack in (False, True):
        batch = collate(trajs, gym_['fmt'].pad_id, pack)
        policy = copy.deepcopy(model)
        ws_loss = T.warm_start_loss(policy, batch, torch.arange(len(batch['ids'])), cfg).item()
        adv = token_advantages(outcome, batch['row_episode'], batch['action_mask'])
        m = T.ppo_update(policy, torch.optim.SGD(policy.parameters(), lr=0.1), batch, adv, None, cfg, random.Random(0))
        results.append((len(batch['ids']), ws_loss, m, weights(policy), [p.grad for p in policy.parameters()]))
    (rows, ws, m, w, g), (rows_p, ws_p, m_p, w_p, g_p) = results
    assert rows_p == len(trajs) < rows
    assert ws_p == pytest.approx(ws, rel=1e-6) and m_p['loss'] == pytest.approx(m['loss'], abs=1e-6)
    assert m_p['ratio_dev_first_minibatch'] <= 1e-5 and m_p['logp_gap_max'] <= 1e-5 and m_p['grad_norm'] > 0
    assert max(float((a - b).abs().max()) for a, b in zip(w, w_p)) <= 1e-7
    assert max(float((a - b).abs().max()) for a, b in zip(g, g_p)) <= 1e-6 < max(float(a.abs().max()) for a in g)


def test_reference_log_probs_are_scored_at_policy_tokens_only():
    """The KL term reads the reference at the policy's tokens (action_mask) alone, so only those are
    projected onto the vocabulary: there they equal the full pass's values, elsewhere they are 0."""
    cfg = load_config(['--gym=memory', '--n_embd=32', '--batch_size=1', '--group_size=4', '--kl_coef=0.05',
                       '--train_tasks=20', '--eval_tasks=4', '--device=cpu'])
    gym_ = load_gym(cfg, None, config)
    torch.manual_seed(0)
    model = load_policy(cfg, gym_['tok'].vocab_size)
    trajs = T.run_tasks(model, gym_, cfg, gym_['train_tasks'][:1], 4, [0], torch.Generator().manual_seed(0))
    batch = T.collate(trajs, gym_['fmt'].pad_id)
    ref_logp, full = T.reference_log_probs(model, batch, cfg), T.batch_log_probs(model, batch, cfg)
    action, real = batch['action_mask'].bool(), batch['attention_mask'][:, 1:].bool()
    assert (real & ~action).any() and (full[real & ~action] != 0).all()  # prompts and observations are scored in full
    assert (ref_logp[~action] == 0).all()
    assert torch.allclose(ref_logp[action], full[action], atol=1e-6) and (ref_logp[action] < 0).all()
