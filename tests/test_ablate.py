import json
import math
import os

import pytest

import ablate


def _write_run(tmp_path, variant, seed, em_k2, pt_k4, extra=()):
    """A finished run as train.py leaves it: config.json as ablate would run it, metrics to its last step."""
    d = tmp_path / f'{variant}_s{seed}'
    d.mkdir(exist_ok=True)
    cfg = ablate.run_config('config/tiny_mem.yaml', variant, seed, str(d), list(extra))[1]
    steps = cfg['steps']
    rows = [dict(step=0, eval_em=0.0, eval_em_k2=0.0, eval_pt_k4=1.0),
            dict(step=steps, loss=0.1, success_rate=0.5, step_time_s=60.0 * (2 if variant == 'mempo' else 1),  # not an eval line
                 **(dict(mem_reward_time_s=15.0, mem_reward_quality_corr=em_k2 - 0.5, mem_adv_abs_mean=0.7,
                         outcome_adv_abs_mean=0.6) if variant == 'mempo' else {})),
            dict(step=steps, eval_em=0.5 + em_k2 / 10, eval_mem_quality_k2=em_k2, eval_em_k1=1.0, eval_f1_k1=1.0, eval_tt_k1=10.0, eval_pt_k1=5.0,
                 eval_em_k2=em_k2, eval_f1_k2=em_k2, eval_tt_k2=20.0, eval_pt_k2=6.0,
                 eval_em_k4=0.25, eval_f1_k4=0.25, eval_tt_k4=40.0, eval_pt_k4=pt_k4)]
    (d / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows) + '{"step": 9, "eval_em"')  # torn line
    (d / 'config.json').write_text(json.dumps(cfg))


def test_parse_args_splits_own_flags_from_train_overrides():
    opts, rest = ablate.parse_args(['--quick', '--out=/x', '--steps=3', '--config=config/other.yaml'])
    assert opts['quick'] and opts['out'] == '/x' and opts['seeds'] == [1] and opts['ks'] == [1, 2, 4, 5]
    assert rest == ['--steps=3'] and opts['config'] == 'config/other.yaml'
    assert ablate.parse_args(['--seeds=4,5'])[0]['seeds'] == [4, 5]
    assert ablate.parse_args(['--rerun=false', '--dry_run=true'])[0]['rerun'] is False
    assert ablate.parse_args(['--rerun=false', '--dry_run=true'])[0]['dry_run'] is True


def test_final_eval_takes_last_complete_eval_line(tmp_path):
    _write_run(tmp_path, 'mempo', 1, 0.75, 60.0)
    last = ablate.final_eval(str(tmp_path / 'mempo_s1' / 'metrics.jsonl'))
    assert last['step'] == 50 and last['eval_em_k2'] == 0.75
    assert ablate.final_eval(str(tmp_path / 'missing.jsonl')) is None


def test_aggregate_mean_and_population_std_over_seeds():
    runs = {'mempo': [dict(step=5, eval_em_k2=0.5, eval_pt_k2=10.0), dict(step=5, eval_em_k2=1.0, eval_pt_k2=20.0)]}
    a = ablate.aggregate(runs, ablate.k_columns([2, 4]))['mempo']
    assert a['em_k2'] == (0.75, 0.25) and a['pt_k2'] == (15.0, 5.0) and a['seeds'] == 2 and a['steps'] == 5
    assert all(math.isnan(x) for x in a['em_k4'])  # k absent from the draw: no number, no crash


def test_main_reuses_finished_runs_and_writes_table_and_json(tmp_path, capsys):
    for v, pt in [('mempo', 60.0), ('grpo_fold', 62.0), ('grpo_full', 240.0)]:
        _write_run(tmp_path, v, 1, 0.75, pt)
    agg = ablate.main([f'--out={tmp_path}', '--seeds=1'])  # finished runs: no train.py is started
    out = capsys.readouterr().out
    assert '| mempo | 2 | 0.750 |' in out and 'full history = 0.25' in out
    saved = json.loads((tmp_path / 'ablation.json').read_text())
    assert saved['aggregate']['grpo_full']['pt_k4'][0] == 240.0 and agg['mempo']['em_k1'][0] == 1.0
    assert math.isnan(agg['mempo']['em_k1'][1])  # one seed: a mean, no standard error


def test_table_has_memory_quality_rl_time_and_learning_curve(tmp_path, capsys):
    for seed, em in [(1, 0.5), (2, 1.0)]:
        for v in ablate.VARIANTS:
            _write_run(tmp_path, v, seed, em, 60.0)
    agg = ablate.main([f'--out={tmp_path}', '--seeds=1,2'])
    out = capsys.readouterr().out
    # memory quality at k=2 is 0.5 and 1.0 over the two seeds: mean 0.75, standard error 0.25
    assert '| mempo | 2 | 0.750 ± 0.250 | 0.750 ± 0.250 | 0.750 ± 0.250 |' in out
    assert 'RL phase (minutes in RL steps, evaluations excluded): mempo 2.0; grpo_fold 1.0' in out
    assert 'MemPO / grpo_fold RL time = 2.00x' in out and agg['mempo']['rl_min'] == (2.0, 0.0)
    assert 'held-out EM by RL step, mempo: 0: 0.000, 50: 0.575 ± 0.025' in out  # eval_em 0.55 and 0.6
    # MemPO's per-step diagnosis: correlation 0 and 0.5 over the seeds; 15 s of a 120 s step
    assert ('mempo per RL step (mean over steps; ± over seeds): memory reward vs memory quality correlation '
            '0.250 ± 0.250; |memory advantage| on <mem> tokens 0.70 against |outcome advantage| 0.60; '
            "memory rewards' share of the step time 0.12") in out
    assert 'grpo_fold per RL step' not in out  # no memory rewards, no line
    assert 'k=2: mempo - grpo_fold EM, paired by seed: 0.000' in out  # both variants wrote the same EM per seed
    runs = {'mempo': [dict(eval_em_k2=0.5), dict(eval_em_k2=0.9)], 'grpo_fold': [dict(eval_em_k2=0.4), dict(eval_em_k2=0.6)]}
    assert ablate.paired_lines(runs, [2, 4]) == ['k=2: mempo - grpo_fold EM, paired by seed: 0.200 ± 0.100 (+2.0 standard errors)']
    runs = dict(runs, grpo_full=runs['mempo'], pmem_turn_found=[dict(eval_val_em_k2=0.3), dict(eval_val_em_k2=0.5)])
    runs['grpo_fold'] = [dict(r, eval_val_em_k2=0.1) for r in runs['grpo_fold']]  # every memory variant against GRPO + folding
    assert ablate.paired_lines(runs, [2], prefix='eval_val_') == ['k=2: pmem_turn_found - grpo_fold EM, paired by seed: 0.300 ± 0.100 (+3.0 standard errors)']
    assert len(ablate.paired_lines(runs, [2])) == 1 and ablate.paired_lines({'mempo': runs['mempo']}, [2]) == []
    saved = json.loads((tmp_path / 'ablation.json').read_text())
    assert saved['runs']['mempo'][1]['curve'] == {'0': 0.0, '50': 0.6}


def test_a_finished_run_with_other_options_is_never_replaced_unasked(tmp_path, monkeypatch, capsys):
    """A finished run counts only for the options it ran with (config.json). Asked for other options
    in its folder, ablate stops before any run, in one line naming them, and the run's files stay
    (every run goes with --overwrite=True); --rerun replaces it; an unfinished run runs again."""
    for v in ablate.VARIANTS:
        _write_run(tmp_path, v, 1, 0.75, 60.0)
    started = []

    def fake_run(cmd, stdout=None):
        started.append(cmd)
        d = next(a.split('=', 1)[1] for a in cmd if a.startswith('--out_dir='))
        variant, seed = d.rsplit('/', 1)[1].rsplit('_s', 1)
        _write_run(tmp_path, variant, int(seed), 0.25, 60.0, extra=['--lr=0.0005'])
        return type('Done', (), dict(returncode=0))()
    monkeypatch.setattr(ablate.subprocess, 'run', fake_run)
    ablate.main([f'--out={tmp_path}', '--seeds=1'])
    assert started == []  # same options: reused
    before = {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()}
    for bad, needle in [('--lr=0.0005', 'mempo_s1 holds a finished run with other options (lr: 0.0001 there, 0.0005 here)'
                                        ': --rerun replaces it, or choose another --out'),
                        ('--bogus=1', "unknown config key 'bogus'"), ('--config=nope.yaml', 'config file not found: nope.yaml')]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:  # stops before any run, in one line
            ablate.main([f'--out={tmp_path}', '--seeds=1', bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and err.count('\n') == 1 and started == []
    assert {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()} == before  # nothing lost
    agg = ablate.main([f'--out={tmp_path}', '--seeds=1', '--lr=0.0005', '--rerun'])
    assert len(started) == 3 and all('--lr=0.0005' in c for c in started) and agg['mempo']['em_k2'][0] == 0.25
    metrics = tmp_path / 'grpo_full_s1' / 'metrics.jsonl'  # stopped before its final evaluation: not finished
    metrics.write_text(metrics.read_text().splitlines(True)[0])
    ablate.main([f'--out={tmp_path}', '--seeds=1', '--lr=0.0005'])
    assert len(started) == 4 and '--out_dir=' + str(tmp_path / 'grpo_full_s1') in started[-1]


def test_quick_runs_land_in_their_own_folder():
    # --quick's short runs in out/ablate would replace (or, now, stop at) the full ablation's runs
    assert ablate.parse_args(['--quick'])[0]['out'] == 'out/ablate_quick'
    assert ablate.parse_args(['--main', '--quick'])[0]['out'] == 'out/seeds_quick'
    assert ablate.parse_args(['--quick', '--out=o'])[0]['out'] == 'o'
    assert ablate.parse_args([])[0]['out'] == 'out/ablate' and ablate.parse_args(['--main'])[0]['out'] == 'out/seeds'


def test_dry_run_prints_one_command_per_variant_and_seed(tmp_path, capsys):
    ablate.main([f'--out={tmp_path}', '--seeds=1,2', '--dry_run', '--steps=3'])
    cmds = capsys.readouterr().out.strip().splitlines()
    assert len(cmds) == 6 and all('--steps=3' in c for c in cmds)
    assert sum('--keep_tool_results=all' in c for c in cmds) == 2 and sum('--mem_coef=0' in c for c in cmds) == 4


def test_named_variants_run_their_memory_credit_options(tmp_path, capsys):
    ablate.main([f'--out={tmp_path}', '--seeds=11', '--dry_run', '--variants=mempo,mempo_turn_found,mempo_nostd'])
    cmds = capsys.readouterr().out.strip().splitlines()
    assert len(cmds) == 3 and '--mem_pool' not in cmds[0]
    assert '--mem_pool=turn --mem_target=found' in cmds[1] and '/mempo_turn_found_s11' in cmds[1] and '--mem_std=false' in cmds[2]
    assert ablate.k_columns([4], 'eval_val_')['em_k4'] == 'eval_val_em_k4'  # --val: the table from validation
    with pytest.raises(SystemExit):
        ablate.parse_args(['--variants=mempo,nope'])


def test_jobs_runs_every_unfinished_run_once_seed_by_seed(tmp_path, monkeypatch, capsys):
    _write_run(tmp_path, 'grpo_fold', 1, 0.75, 62.0)  # finished: not started again
    started = []

    def fake_run(cmd, stdout=None):
        d = next(a.split('=', 1)[1] for a in cmd if a.startswith('--out_dir='))
        started.append(d)
        variant, seed = d.rsplit('/', 1)[1].rsplit('_s', 1)
        _write_run(tmp_path, variant, int(seed), 0.5, 100.0)
        return type('Done', (), dict(returncode=0))()

    monkeypatch.setattr(ablate.subprocess, 'run', fake_run)
    agg = ablate.main([f'--out={tmp_path}', '--seeds=1,2', '--jobs=1'])
    names = [d.rsplit('/', 1)[1] for d in started]
    assert sorted(names) == ['grpo_fold_s2', 'grpo_full_s1', 'grpo_full_s2', 'mempo_s1', 'mempo_s2']
    assert names == ['mempo_s1', 'grpo_full_s1', 'mempo_s2', 'grpo_fold_s2', 'grpo_full_s2']  # whole seeds; MemPO first
    out = capsys.readouterr().out  # one line as each run starts and one as it ends
    assert out.count('started  ') == 5 and out.count('finished ') == 5 and 'finished mempo seed 1 in ' in out
    assert agg['grpo_fold']['em_k2'] == (0.625, 0.125) and agg['grpo_fold']['seeds'] == 2
    assert ablate.parse_args(['--jobs=2'])[0]['jobs'] == 2


def test_failed_run_stops_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ablate.subprocess, 'run', lambda cmd, stdout=None: type('Done', (), dict(returncode=1))())
    with pytest.raises(SystemExit) as e:
        ablate.main([f'--out={tmp_path}', '--seeds=1', '--jobs=2'])
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert 'error: the mempo run (seed 1) failed' in cap.err and 'FAILED   mempo seed 1 in ' in cap.out


def _write_main_run(d, seed, extra, successes, val):
    """A finished main-job run as train.py leaves it (config.json, metrics: step 0 evaluation, one
    line per RL step with its train success, the evaluation at the last step)."""
    cfg = ablate.run_config('config/tiny.yaml', 'main', seed, str(d), list(extra))[1]
    rows = [dict(step=0, eval_success_rate=0.0, eval_greedy_success=0.0, eval_val_success=0.0, eval_em_k2=0.1 * seed)]
    rows += [dict(step=s, success_rate=x, loss=0.1) for s, x in enumerate(successes, 1)]
    rows[-1].update(eval_success_rate=0.5 + seed / 10, eval_greedy_success=0.5, eval_val_success=val,
                    eval_val_greedy_success=val, eval_em_k2=0.5 * seed)
    d.mkdir(exist_ok=True)
    (d / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (d / 'config.json').write_text(json.dumps(cfg))


def test_main_sweeps_seeds_of_the_main_job_with_mean_and_standard_error(tmp_path, monkeypatch, capsys):
    opts, rest = ablate.parse_args(['--main', '--seeds=1,2', '--lr=0.001'])
    assert (opts['config'], opts['out'], opts['seeds'], rest) == ('config/tiny.yaml', 'out/seeds', [1, 2], ['--lr=0.001'])
    opts = ablate.parse_args(['--main', '--config=c.yaml', '--out=o'])[0]
    assert (opts['config'], opts['out']) == ('c.yaml', 'o')
    small = ['--steps=2', '--warmstart_steps=4', '--eval_tasks=4']
    started = []

    def fake_run(cmd, stdout=None):  # train.py's files for --steps=2: train success 0 then 1 per step
        d = next(a.split('=', 1)[1] for a in cmd if a.startswith('--out_dir='))
        seed = int(next(a.split('=', 1)[1] for a in cmd if a.startswith('--seed=')))
        started.append(cmd)
        _write_main_run(tmp_path / f'main_s{seed}', seed, small, [0.0, 1.0], 0.25 * seed)
        return type('Done', (), dict(returncode=0))()
    monkeypatch.setattr(ablate.subprocess, 'run', fake_run)
    agg = ablate.main(['--main', f'--out={tmp_path}', '--seeds=1,2,3', '--jobs=2', *small])['main']
    assert len(started) == 3 and all(c[2] == 'config/tiny.yaml' and all(a in c for a in small) for c in started)
    assert agg['seeds'] == 3 and agg['steps'] == 2 and agg['train (last 10 steps)'] == (0.5, 0.0)
    m, se = agg['validation']  # 0.25, 0.5, 0.75: sample std 0.25, standard error 0.25 / sqrt(3)
    assert m == pytest.approx(0.5) and se == pytest.approx(0.25 / math.sqrt(3))
    assert agg['held-out'][0] == pytest.approx(0.7) and agg['held-out greedy'] == (0.5, 0.0)
    assert agg['wall (min)'][0] >= 0 and all((tmp_path / f'main_s{s}' / ablate.WALL).exists() for s in (1, 2, 3))
    out = capsys.readouterr().out
    assert '| config | validation | held-out | held-out greedy | train (last 10 steps) | wall (min) | steps | seeds |' in out
    assert '| config/tiny.yaml | 0.500 ± 0.144 | 0.700 ± 0.058 | 0.500 | 0.500 | ' in out
    # RL over the warm start, paired by seed: held-out gains 0.6, 0.7, 0.8 (standard error 0.1 / sqrt(3))
    assert 'held-out: 0.000 -> 0.700 ± 0.058, gain +0.700 ± 0.058 (+12.1 standard errors); by seed 1 +0.600, 2 +0.700, 3 +0.800' in out
    assert 'held-out EM k=2: 0.200 ± 0.058 -> 1.000 ± 0.289, gain +0.800 ± 0.231 (+3.5 standard errors); by seed 1 +0.400' in out
    assert 'held-out greedy: 0.000 -> 0.500, gain +0.500; by seed 1 +0.500, 2 +0.500, 3 +0.500' in out
    assert 'held-out EM:' not in out and 'truncated' not in out  # numbers the runs do not log get no line
    saved = json.loads((tmp_path / 'ablation.json').read_text())
    assert saved['aggregate']['main']['validation'][0] == pytest.approx(0.5) and len(saved['runs']['main']) == 3
    # finished runs are reused (same options); one seed alone shows means without an error
    agg = ablate.main(['--main', f'--out={tmp_path}', '--seeds=2', *small])['main']
    assert len(started) == 3 and agg['validation'][0] == 0.5 and math.isnan(agg['validation'][1])
    assert '| config/tiny.yaml | 0.500 | 0.700 | 0.500 | 0.500 | ' in capsys.readouterr().out


def test_mean_se():
    assert ablate.mean_se([0.5, 1.0]) == (0.75, pytest.approx(0.25))  # sample std 0.354 / sqrt(2)
    assert ablate.mean_se([2.0])[0] == 2.0 and math.isnan(ablate.mean_se([2.0])[1])
    assert all(math.isnan(x) for x in ablate.mean_se([]))


def test_main_dry_run_runs_the_main_config_once_per_seed(tmp_path, capsys):
    ablate.main(['--main', f'--out={tmp_path}', '--seeds=1,2', '--dry_run', '--steps=2'])
    cmds = capsys.readouterr().out.strip().splitlines()
    assert len(cmds) == 2 and all(c.startswith('python train.py config/tiny.yaml --seed=') and '--steps=2' in c for c in cmds)


def test_dry_run_stops_on_a_key_the_gym_ignores(tmp_path, capsys):
    """oracle_forget is a memory-gym key: the main job (bugfix) would ignore it, so no run starts."""
    with pytest.raises(SystemExit) as e:
        ablate.main(['--main', f'--out={tmp_path}', '--seeds=1', '--dry_run', '--oracle_forget=0.5'])
    assert e.value.code == 2 and "config key 'oracle_forget' is not used by gym 'bugfix'" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize('arg', ['--jobs=abc', '--jobs=0', '--jobs=1,2', '--seeds=1,x', '--ks=two', '--ks=0,2',
                                 '--seeds=1,1', '--out', '--config', '--out=', '--quick=nope', '--rerun=maybe'])
def test_bad_flags_exit_with_one_line(arg, capsys):
    with pytest.raises(SystemExit) as e:
        ablate.parse_args([arg])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith('error: --') and err.count('\n') == 1


@pytest.mark.parametrize('args, needle', [
    (['--mem_coef=0.5'], "--mem_coef cannot be passed through: ablate.py sets it for each run"),
    (['--keep_tool_results=2'], '--keep_tool_results cannot be passed through'),
    (['--seed=7'], '--seed cannot be passed through: ablate.py sets it for each run (use --seeds)'),
    (['--out_dir=x'], '--out_dir cannot be passed through: ablate.py sets it for each run (use --out)'),
    (['--config=config/smoke.yaml'], 'config/smoke.yaml: mem_coef is 0, so the mempo variant would be grpo_fold'),
    (['config/tiny_mem.yaml'], 'config/tiny_mem.yaml: ablate.py takes one config file, as --config=config/tiny_mem.yaml'),
])
def test_keys_that_would_undo_a_variant_or_a_seed_stop_with_one_line(args, needle, capsys, tmp_path):
    """A passed-through key that ablate sets itself (the variants' keys, the seed, the out_dir) would make
    the variants or the seeds alike, silently: refused before any run."""
    with pytest.raises(SystemExit) as e:
        ablate.main([f'--out={tmp_path}', '--dry_run', '--seeds=1', *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count('\n') == 1
    assert ablate.parse_args(['--main', '--keep_tool_results=2'])[1] == ['--keep_tool_results=2']  # --main: a plain key


def test_a_finished_dtype_auto_run_is_not_run_again(tmp_path):
    # train.py saves the dtype auto chose; ablate compared it with 'auto' and reran the finished run
    # with --overwrite=True (config/smollm2_memory.yaml has dtype: auto)
    _write_run(tmp_path, 'mempo', 1, 0.75, 60.0)
    d = tmp_path / 'mempo_s1'
    saved = json.loads((d / 'config.json').read_text())
    for chosen, asked, finished in (('bfloat16', 'auto', True), ('float32', 'auto', True), ('float32', 'bfloat16', False)):
        (d / 'config.json').write_text(json.dumps(dict(saved, dtype=chosen)))  # as train.py saves it
        cfg = ablate.run_config('config/tiny_mem.yaml', 'mempo', 1, str(d), [f'--dtype={asked}'])[1]
        assert (ablate.finished_differences(str(d), cfg) == {}) is finished, (chosen, asked)


def test_a_finished_run_named_by_another_path_is_not_run_again(tmp_path, monkeypatch, capsys):
    """--out as an absolute path, or with ./, names the same finished runs: none is started (each would
    rerun with --overwrite and lose its checkpoints)."""
    for v in ablate.VARIANTS:
        _write_run(tmp_path, v, 1, 0.75, 60.0)
    monkeypatch.setattr(ablate.subprocess, 'run', lambda *a, **k: pytest.fail(f'started {a}'))
    config = os.path.abspath('config/tiny_mem.yaml')
    monkeypatch.chdir(tmp_path.parent)
    for out in (str(tmp_path), f'./{tmp_path.name}', f'{tmp_path.name}/'):
        assert ablate.main([f'--out={out}', '--seeds=1', f'--config={config}'])['mempo']['em_k2'][0] == 0.75
    monkeypatch.chdir(os.path.dirname(config) + '/..')
    assert ablate.finished_differences(str(tmp_path / 'mempo_s1'), dict(ablate.run_config(
        'config/tiny_mem.yaml', 'mempo', 1, str(tmp_path / 'mempo_s1'), ['--steps=7'])[1]))  # other options: not finished
