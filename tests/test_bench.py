import importlib.util
import json
import math
import re

import pytest
import torch

import bench
from model import TinyAgent
from model import generate

KEYS = {'name', 'value', 'baseline', 'ratio', 'unit'}


def run_smoke(tmp_path, only):
    path = tmp_path / 'bench.json'
    bench.main(['--smoke', f'--only={only}', f'--json={path}'])
    torch.set_num_threads(1)  # main pinned it already; keep the rest of the suite on one thread either way
    return json.loads(path.read_text())


def check_rows(rows, names):
    assert [r['name'] for r in rows] == names
    for r in rows:
        assert KEYS <= set(r)
        assert r['value'] > 0 and r['baseline'] > 0 and math.isfinite(r['ratio'])
        assert r['ratio'] == pytest.approx(r['value'] / r['baseline'])


def test_nocache_baseline_samples_the_same_tokens_as_kv_cache_greedy():
    torch.manual_seed(0)
    model = TinyAgent(64, n_layer=2, n_head=2, n_embd=32, max_len=64).eval()
    contexts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # unequal lengths: left padding must not matter
    ours, _ = generate(model, contexts, [], 20, temperature=0.0)
    assert bench.generate_nocache(model, contexts, 20, temperature=0.0) == ours


def test_nocache_baseline_matches_kv_cache_greedy_on_tiny_qwen3():
    from model import tiny_qwen3
    model = tiny_qwen3(hidden=32)
    contexts = [[9707, 1879, 11], [40, 1079]]
    ours, _ = generate(model, contexts, [], 6, temperature=0.0, pad_id=151643)
    assert bench.generate_nocache(model, contexts, 6, temperature=0.0, pad_id=151643) == ours


@pytest.mark.parametrize('args, needle', [(['--threads=0'], '--threads must be >= 1, got 0'),
                                           (['--json=/nonexistent/x.json'], 'folder /nonexistent does not exist')])
def test_bad_options_stop_before_any_benchmark(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_smoke_json_rows_have_required_keys_and_names(tmp_path):
    rows = run_smoke(tmp_path, 'tiny,hf,ppo,mem')
    check_rows(rows, ['tiny_rollout_kv_vs_nocache_64', 'tiny_rollout_kv_vs_nocache_128',
                      'tiny_rollout_kv_vs_nocache_256', 'hf_rollout_vs_generate', 'multiturn_rollout_kv_reuse_vs_reprefill',
                      'ppo_update_tokens_per_s', 'ppo_update_skip_zero_advantage',
                      'memory_rewards_shared_history_vs_row_per_turn', 'ppo_update_packed_turns_vs_rows_tiny'])
    assert rows[-4]['mfu'] > 0  # against the measured CPU matmul peak
    # both updates took the same step from the same weights (every repetition: they stay alike)
    assert float(rows[-3]['note'].split('max |weight difference| ')[1]) <= 1e-6 and ' of ' in rows[-3]['note']
    gap = float(rows[-2]['note'].split('max |difference| ')[1])  # the two ways give the same rewards
    assert gap <= 1e-6 and ' 0 scored turns' not in rows[-2]['note']
    rows_per_turn, packed = (int(x) for x in re.findall(r'(\d+) rows of', rows[-1]['note']))
    assert packed < rows_per_turn  # folded turns were packed


def test_a_run_stopped_midway_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    def stopped(*args):
        raise KeyboardInterrupt  # as a time limit stops a GPU check between two groups of rows
    monkeypatch.setattr(bench, 'bench_memory_rewards', stopped)
    path = tmp_path / 'bench.json'
    with pytest.raises(KeyboardInterrupt):
        bench.main(['--smoke', '--only=ppo,mem', f'--json={path}'])
    torch.set_num_threads(1)
    check_rows(json.loads(path.read_text()), ['ppo_update_tokens_per_s', 'ppo_update_skip_zero_advantage'])


def test_smoke_bf16_rows_compare_bf16_with_float32(tmp_path):
    rows = run_smoke(tmp_path, 'bf16')
    check_rows(rows, ['ppo_update_bf16_vs_fp32_tiny', 'rollout_bf16_vs_fp32_tiny', 'ppo_update_tis_cap_vs_none_tiny',
                      'logprob_chunks_kept_vs_recomputed_tiny'])
    assert bench.model_lib.LOGITS_KEPT_BYTES == 2 ** 30  # the row puts the bound back
    assert rows[0]['mfu'] > 0 and 'bfloat16 matmul' in rows[0]['peak_source']
    bf16, fp32 = (float(x) for x in rows[0]['note'].split('logp_gap_max bf16 ')[1].split(', float32 '))
    assert fp32 <= 1e-5 < bf16  # the batch's log-probs are float32's: bf16 rounds away from them


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec('trl') is None, reason='trl is in requirements-bench.txt only')
def test_smoke_rl_step_vs_trl_row(tmp_path):
    check_rows(run_smoke(tmp_path, 'rl'), ['rl_step_vs_trl'])
