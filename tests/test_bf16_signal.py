"""bf16 and signal: dtype auto follows the hardware; truncated importance sampling (tis_cap) makes the
first ratio exactly 1 in bf16 and weights tokens by the sampler/trainer gap; groups without signal
are counted, and dynamic sampling (oversample) keeps those with signal without ever looping."""
import copy
import dataclasses
import json
import random

import pytest
import torch

import config as config_lib
import train
from advantage import (compute_advantages, grpo_advantage, has_signal, keep_groups_with_signal, tis_weights,
                       token_advantages, training_rewards)
from test_ppo import setup


# -----------------------------------------------------------------------------
# dtype: auto


def test_dtype_auto_follows_the_cpu_flags():
    assert config_lib.native_dtype('cpu', 'fpu sse avx2 avx512f') == ('float32', 'no native bf16 on this CPU')
    assert config_lib.native_dtype('cpu', 'fpu avx512f avx512_bf16') == ('bfloat16', 'this CPU has avx512_bf16')
    assert config_lib.native_dtype('cpu', 'fpu amx_tile amx_bf16')[0] == 'bfloat16'
    assert config_lib.native_dtype('cpu', 'avx512_bf16x')[0] == 'float32'  # a whole flag, not a prefix
    assert config_lib.native_dtype('cpu', '')[0] == 'float32'


def test_check_run_resolves_auto_and_says_why(capsys, monkeypatch):
    monkeypatch.setattr(config_lib, 'native_dtype', lambda device: ('float32', 'no native bf16 on this CPU'))
    cfg = config_lib.load_config(['--dtype=auto', '--gym=example', '--device=cpu'])
    config_lib.check_run(cfg)
    assert cfg['dtype'] == 'float32' and 'dtype auto: float32 (no native bf16 on this CPU)' in capsys.readouterr().out


@pytest.mark.parametrize('flags, warned', [('no native bf16 on this CPU', True), ('this CPU has avx512_bf16', False)])
def test_explicit_bfloat16_without_native_bf16_warns_and_runs_bf16(capsys, monkeypatch, flags, warned):
    monkeypatch.setattr(config_lib, 'native_dtype', lambda device: ('float32' if warned else 'bfloat16', flags))
    cfg = config_lib.load_config(['--dtype=bfloat16', '--gym=example', '--device=cpu'])
    config_lib.check_run(cfg)
    err = capsys.readouterr().err
    assert cfg['dtype'] == 'bfloat16'
    assert ('warning: dtype bfloat16 with no native bf16 on this CPU: bf16 is emulated there or not run at all' in err) == warned


# -----------------------------------------------------------------------------
# truncated importance sampling


def test_tis_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    sampler = torch.tensor([[-1.0, -1.0, -2.5, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = tis_weights(trainer, sampler, mask, cap=2.0)
    # exp(0) = 1; exp(-1) = 0.368 (the trainer finds the token less likely: weighted down); exp(2) = 7.39 -> 2
    assert torch.allclose(w, torch.tensor([[1.0, float(torch.exp(torch.tensor(-1.0))), 2.0, 1.0]]))


def test_bf16_first_ratio_is_exactly_one_with_tis_and_the_gap_is_logged():
    model, batch, adv, cfg = setup(dtype='bfloat16')  # sampled in bf16: the KV-cache decoder rounds otherwise
    cfg = dict(cfg, mini_batches=2, max_tokens_per_microbatch=600)
    frozen = copy.deepcopy(model)
    plain = train.ppo_update(frozen, torch.optim.AdamW(frozen.parameters(), lr=1e-3), batch, adv, None, cfg, random.Random(0))
    assert plain['ratio_dev_first_minibatch'] > 0 and plain['logp_gap_max'] > 1e-4  # bf16 rounds by batch shape
    m = train.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, adv, None,
                         dict(cfg, tis_cap=2.0), random.Random(0))
    assert m['ratio_dev_first_minibatch'] == 0.0 and m['grad_norm'] > 0
    assert m['logp_gap_max'] == plain['logp_gap_max'] and 0 < m['logp_gap_mean'] <= m['logp_gap_max']
    assert 0 < m['tis_weight_mean'] <= 2.0 and 0 <= m['tis_capped_frac'] <= 1
    batch['rewards'][:4] = 1.0  # the first group without signal, its rows skipped: the ratio is still exactly 1
    adv = token_advantages(grpo_advantage(batch['rewards'], batch['group_ids']), batch['row_episode'],
                           batch['action_mask'])
    s = train.ppo_update(frozen, torch.optim.AdamW(frozen.parameters(), lr=1e-3), batch, adv, None,
                         dict(cfg, tis_cap=2.0, skip_zero_advantage=True), random.Random(0))
    assert s['ratio_dev_first_minibatch'] == 0.0 and s['grad_norm'] > 0 and 0 < s['tis_weight_mean'] <= 2.0


def test_tis_takes_the_first_minibatchs_old_logprobs_from_its_own_forward(monkeypatch):
    """The no-grad old pass skips the first mini-batch, whose forward gives the same bits: weights and
    metrics equal those of the algorithm before the shortcut (a pass over its rows first, then the loss
    on advantages weighted by tis_weights), and a first mini-batch left unweighted would differ."""
    model, batch, adv, cfg = setup(dtype='bfloat16')
    cfg = dict(cfg, mini_batches=2, ppo_epochs=2, max_tokens_per_microbatch=300, tis_cap=2.0)
    before = copy.deepcopy(model)
    m = train.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, adv, None, cfg, random.Random(0))
    minibatch_loss, passes = train.minibatch_loss, []

    def pass_first(model_, batch_, rows, mask, w, adv_, old_logp, ref_logp, cfg_, backward, sums, first=None, tis_mask=None):
        if tis_mask is not None:  # the first mini-batch as before: its rows' no-grad pass, then weighted advantages
            old_logp[rows] = train.batch_log_probs(model_, batch_, cfg_, [rows], tis_mask)[rows]
            passes.append(old_logp[rows].clone())
            adv_ = adv_ * tis_weights(old_logp, batch_['sample_logp'], tis_mask, cfg_['tis_cap'])
        return minibatch_loss(model_, batch_, rows, mask, w, adv_, old_logp, ref_logp, cfg_, backward, sums, first)

    monkeypatch.setattr(train, 'minibatch_loss', pass_first)
    f = train.ppo_update(before, torch.optim.AdamW(before.parameters(), lr=1e-3), batch, adv, None, cfg, random.Random(0))
    assert len(passes) == 1 and passes[0].abs().sum() > 0 and f['ratio_dev_first_minibatch'] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    assert m == f and m['grad_norm'] > 0 and m['tis_weight_mean'] != 1.0


def test_an_update_that_computes_no_token_logs_none_not_zero():
    model, batch, adv, cfg = setup(dtype='bfloat16')
    batch['rewards'][:] = 1.0  # every group all-equal: skip_zero_advantage leaves every row out
    adv = token_advantages(grpo_advantage(batch['rewards'], batch['group_ids']), batch['row_episode'], batch['action_mask'])
    m = train.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, adv, None,
                         dict(cfg, tis_cap=2.0, skip_zero_advantage=True), random.Random(0))
    measured = ('entropy', 'clip_frac', 'logp_gap_max', 'logp_gap_mean', 'ratio_dev_first_minibatch',
                'tis_weight_mean', 'tis_capped_frac')
    assert all(m[k] is None for k in measured) and m['grad_norm'] == 0.0 and m['bad_steps'] == 0


def test_float32_keeps_its_exact_gap_and_numbers_without_tis():
    model, batch, adv, cfg = setup()
    m = train.ppo_update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, adv, None, cfg, random.Random(0))
    assert m['logp_gap_max'] <= 1e-5 and m['logp_gap_mean'] <= 1e-5 and 'tis_weight_mean' not in m


# -----------------------------------------------------------------------------
# groups without signal


def test_has_signal_counts_groups_whose_valid_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, float('nan'), 0.0])
    valid = torch.tensor([True, True, True, True, True, False, True])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert has_signal(rewards, valid, groups) == {0: False, 1: True, 2: False, 3: False}  # 2: one valid; 3: one


# what keep_groups_with_signal and training_rewards read of an episode
Traj = dataclasses.make_dataclass('Traj', ['reward', 'valid', 'group',
                                          ('info', dict, dataclasses.field(default_factory=dict))])


def test_dynamic_sampling_keeps_groups_with_signal_first_and_renumbers():
    trajs = [Traj(r, True, g) for g, rs in enumerate([(0, 0), (1, 0), (1, 1), (0, 1)]) for r in rs]
    kept, zero_var = keep_groups_with_signal(trajs, 2)
    assert [(t.reward, t.group) for t in kept] == [(1, 0), (0, 0), (0, 1), (1, 1)] and zero_var == 0.5


def test_dynamic_sampling_never_loops_when_no_group_has_signal(tmp_path, monkeypatch):
    """All groups all-equal: batch_size of them are kept, no second draw; and train.py's step runs
    with oversample end to end (the example gym, groups of 2, often all-equal), choosing its groups
    on the rewards the advantages see (truncation_penalty passed on)."""
    trajs = [Traj(0.0, True, g) for g in range(6) for _ in range(3)]
    kept, zero_var = keep_groups_with_signal(trajs, 4)
    assert sorted({t.group for t in kept}) == [0, 1, 2, 3] and len(kept) == 12 and zero_var == 1.0
    penalties = []
    monkeypatch.setattr(train, 'keep_groups_with_signal',
                        lambda trajs, n, p: penalties.append(p) or keep_groups_with_signal(trajs, n, p))
    train.main(['config/example.yaml', '--warmstart_episodes=16', '--warmstart_steps=4', '--steps=2', '--batch_size=2',
                '--group_size=2', '--oversample=2.0', '--eval_tasks=2', '--eval_samples=1', '--truncation_penalty=0.25',
                f'--out_dir={tmp_path}'])
    rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert [r['step'] for r in rows] == [0, 1, 2] and penalties == [0.25, 0.25]
    for r in rows[1:]:
        assert 0 <= r['zero_var_groups'] <= r['zero_var_groups_sampled'] <= 1 and r['tokens'] > 0


# -----------------------------------------------------------------------------
# truncation_penalty: a loop that runs out of turns scores below a wrong answer


def test_truncation_penalty_gives_signal_to_a_group_of_failures():
    """Group 0: two wrong answers and two episodes cut by a limit (the gym's own turn budget, the
    rollout's); all score 0, so the gym's rewards carry no signal. With truncation_penalty 0.5 the cut
    ones score -0.5: the answers get advantage +1, the loops -1. Group 1 (a success, a cut loop, two
    wrong answers): success > wrong > cut. Penalty 0: the gym's rewards exactly. Dynamic sampling, of
    three groups where only one has a wrong answer beside a loop, keeps that one first."""
    stops = [('answer', 0.0), ('max_turns', 0.0), ('answer', 0.0), ('max_len', 0.0),
             ('answer', 1.0), ('budget', 0.0), ('answer', 0.0), ('answer', 0.0)]
    trajs = [Traj(r, True, i // 4, {'stop': s}) for i, (s, r) in enumerate(stops)]
    assert training_rewards(trajs).tolist() == [t.reward for t in trajs]
    rewards = training_rewards(trajs, 0.5)
    assert rewards.tolist() == [0.0, -0.5, 0.0, -0.5, 1.0, -0.5, 0.0, 0.0]
    assert [t.reward for t in trajs] == [r for _, r in stops]  # the episodes' own rewards are untouched
    n = len(trajs)
    batch = dict(group_ids=torch.tensor([t.group for t in trajs]), valid=torch.ones(n, dtype=torch.bool),
                 row_episode=torch.arange(n), action_mask=torch.ones(n, 3), mem_mask=torch.zeros(n, 3),
                 turn_ids=torch.zeros(n, 3, dtype=torch.long), rewards=torch.tensor([t.reward for t in trajs]))
    cfg = dict(truncation_penalty=0.0, adv_std=True, adv_eps=1e-6, mem_coef=0.0)
    adv, stats = compute_advantages(None, {}, cfg, trajs, batch)
    assert not adv[:4].any() and stats['zero_var_groups'] == 0.5
    adv, stats = compute_advantages(None, {}, dict(cfg, truncation_penalty=0.5), trajs, batch)
    assert torch.allclose(adv[:4, 0], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)
    assert adv[4, 0] > adv[6, 0] > adv[5, 0] and stats['zero_var_groups'] == 0.0  # success > wrong > cut
    trajs = [Traj(0.0, True, g, {'stop': 'answer' if g == 2 and i else 'max_turns'}) for g in range(3)
             for i in range(2)]  # only group 2 has a wrong answer beside a loop
    kept, zero_var = keep_groups_with_signal(trajs, 1, truncation_penalty=0.5)
    assert [t.info['stop'] for t in kept] == ['max_turns', 'answer'] and abs(zero_var - 2 / 3) < 1e-9
    assert keep_groups_with_signal(trajs, 1)[1] == 1.0  # without the penalty no group has signal
