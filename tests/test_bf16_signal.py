"""bf16 and signal: dtype auto follows the hardware; truncated importance sampling (tis_cap) makes the
first ratio exactly 1 in bf16 and weights tokens by the sampler/trainer gap; groups without signal
are counted, and dynamic sampling (oversample) keeps those with signal without ever looping."""
import copy
import dataclasses
import json
import random

import torch

import config as config_lib
import train
from advantage import grpo_advantage, has_signal, keep_groups_with_signal, tis_weights, token_advantages
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


Traj = dataclasses.make_dataclass('Traj', ['reward', 'valid', 'group'])  # what keep_groups_with_signal reads


def test_dynamic_sampling_keeps_groups_with_signal_first_and_renumbers():
    trajs = [Traj(r, True, g) for g, rs in enumerate([(0, 0), (1, 0), (1, 1), (0, 1)]) for r in rs]
    kept, zero_var = keep_groups_with_signal(trajs, 2)
    assert [(t.reward, t.group) for t in kept] == [(1, 0), (0, 0), (0, 1), (1, 1)] and zero_var == 0.5


def test_dynamic_sampling_never_loops_when_no_group_has_signal(tmp_path):
    """All groups all-equal: batch_size of them are kept, no second draw; and train.py's step runs
    with oversample end to end (the example gym, groups of 2, often all-equal)."""
    trajs = [Traj(0.0, True, g) for g in range(6) for _ in range(3)]
    kept, zero_var = keep_groups_with_signal(trajs, 4)
    assert sorted({t.group for t in kept}) == [0, 1, 2, 3] and len(kept) == 12 and zero_var == 1.0
    train.main(['config/example.yaml', '--warmstart_episodes=16', '--warmstart_steps=4', '--steps=2', '--batch_size=2',
                '--group_size=2', '--oversample=2.0', '--eval_tasks=2', '--eval_samples=1', f'--out_dir={tmp_path}'])
    rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert [r['step'] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert 0 <= r['zero_var_groups'] <= r['zero_var_groups_sampled'] <= 1 and r['tokens'] > 0
