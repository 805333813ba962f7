import json
import os
import random
import sys
from html.parser import HTMLParser

import pytest
import torch

import report
import sample
import train
from gym import OWNER, build_tokenizer, load_gym, word_format
from gyms import bugfix as gb
from model import TinyAgent
from rollout import collate, rollout_batch

OWNER_NAME = {v: k for k, v in OWNER.items()}


class Cells(HTMLParser):
    """Collect every token cell of a page: episodes[k] = list of (attrs, text) in page order."""

    def __init__(self):
        super().__init__()
        self.episodes, self.cell, self.in_text, self.scripts = [], None, False, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.scripts += tag in ('script', 'link', 'img', 'iframe')
        if tag == 'section' and 'data-episode' in a:
            self.episodes.append([])
        elif tag == 'span' and 'data-pos' in a:
            self.cell = [a, '']
            self.episodes[-1].append(self.cell)
        elif tag == 'b' and self.cell is not None:
            self.in_text = True

    def handle_endtag(self, tag):
        if tag == 'b':
            self.in_text = False
        elif tag == 'span' and self.cell is not None and not self.in_text:
            self.cell = None

    def handle_data(self, data):
        if self.in_text:
            self.cell[1] += data


def parse(page):
    p = Cells()
    p.feed(page)
    return p


def check_cells(cells, traj, tok):
    """Every token of the trajectory is one cell, in order, with its id, owner, mask, mem and text."""
    ids, owner = traj.ids.tolist(), traj.owner.tolist()
    mask, mem = traj.action_mask.tolist(), traj.mem_mask.tolist()
    assert len(cells) == len(ids)
    for j, (a, text) in enumerate(cells):
        assert int(a['data-pos']) == j and int(a['data-id']) == ids[j]
        assert a['data-owner'] == OWNER_NAME[owner[j]]
        assert a['data-mask'] == ('' if j == 0 else str(int(mask[j - 1])))
        assert a['data-mem'] == ('0' if j == 0 else str(int(mem[j - 1])))
        assert ('mem' in a['class'].split()) == (a['data-mem'] == '1')
        assert f"o-{a['data-owner']}" in a['class'].split()
        assert text == tok.itos[ids[j]]
        # the invariant the page makes visible: mask 1 exactly on policy tokens
        assert (a['data-mask'] == '1') == (j > 0 and a['data-owner'] == 'policy')


# -----------------------------------------------------------------------------
# BugFix


@pytest.fixture(scope='module')
def bugfix():
    tasks = gb.make_tasks('heldout')[:3]
    tok = build_tokenizer(gb.bugfix_texts(tasks))
    fmt = word_format(tok)
    cfg = dict(max_turns=8, max_len=256, max_response_tokens=6, keep_tool_results='all', temperature=1.0)
    policies = [gb.scripted_policy(kind, 0) for kind in ('tester', 'oracle', 'random')]
    trajs = rollout_batch([lambda ep, p=p: p(ep.texts, ep.task) for p in policies], fmt,
                          [gb.BugFixEnv() for _ in tasks], tasks, cfg)
    torch.manual_seed(0)  # an untrained model: malformed calls, specials written by the policy
    model = TinyAgent(tok.vocab_size, 1, 2, 32, 256)
    trajs += rollout_batch(model, fmt, [gb.BugFixEnv()], tasks[:1], cfg,
                           generator=torch.Generator().manual_seed(0))
    return tok, trajs


def test_html_cells_match_bugfix_trajectory_owner_and_mask(bugfix):
    tok, trajs = bugfix
    page = parse(sample.render_html(trajs, tok))
    assert len(page.episodes) == len(trajs)
    for cells, t in zip(page.episodes, trajs):
        check_cells(cells, t, tok)
    assert {a['data-owner'] for cells in page.episodes for a, _ in cells} == set(OWNER)


def test_html_is_self_contained(bugfix):
    tok, trajs = bugfix
    page = sample.render_html(trajs, tok)
    assert page.startswith('<!doctype html>') and '<style>' in page
    assert parse(page).scripts == 0 and 'http' not in page and '@import' not in page


def test_html_shows_reward_and_stop_per_episode(bugfix):
    tok, trajs = bugfix
    page = sample.render_html(trajs, tok)
    for k, t in enumerate(trajs):
        assert f'data-episode="{k}" data-reward="{t.reward:g}" data-stop="{t.info["stop"]}"' in page


def test_print_episode_turn_by_turn(bugfix, capsys):
    tok, trajs = bugfix
    sample.print_episode(trajs[1], tok)  # oracle: read, edit, test, submit
    out = capsys.readouterr().out
    assert 'prompt (' in out and 'policy: <call> submit </call>' in out
    assert '--- turn 1 · context' in out and '--- turn 4 · context' in out and '--- turn 0 ' not in out  # from 1
    assert 'obs:    def ' in out and 'reward 1 · stop submit' in out


# -----------------------------------------------------------------------------
# memory gym (folded contexts)


@pytest.fixture(scope='module')
def memory():
    cfg = train.load_config(['--gym=memory', '--keep_tool_results=1', '--max_response_tokens=24', '--max_len=384',
                             '--train_tasks=16', '--eval_tasks=8', '--out_dir=unused'])
    g = load_gym(cfg)
    tasks = g['eval_tasks'][:2]
    oracle = rollout_batch([g['warm_policy'](random.Random(0)) for _ in tasks], g['fmt'],
                           [g['make_env']() for _ in tasks], tasks, cfg)
    torch.manual_seed(0)
    model = TinyAgent(g['tok'].vocab_size, 1, 2, 32, 384)
    sampled = sample.run_episodes(model, g, cfg, 'heldout', 3)
    return cfg, g, model, oracle, sampled


def test_html_highlights_mem_spans(memory):
    cfg, g, _, oracle, _ = memory
    page = sample.render_html(oracle, g['tok'])
    assert '.tok.mem' in page  # the highlight has a style
    n = len(oracle[0].turns)  # labels and tooltips count turns from 1; data-turn keeps the row index
    assert f'turn {n}<br>context' in page and f' · turn {n}' in page and ' · turn 0' not in page and ' · prompt' in page
    for cells, t in zip(parse(page).episodes, oracle):
        check_cells(cells, t, g['tok'])
        spans = {}
        for a, text in cells:
            if a['data-mem'] == '1':
                spans.setdefault(int(a['data-turn']), []).append(text)
        assert sorted(spans) == list(range(len(t.turns)))  # the oracle writes a memory every turn
        for k, words in spans.items():
            mem_len = t.turns[k]['mem_len']
            assert words == [g['tok'].itos[i] for i in t.turns[k]['response'][:mem_len]]
            assert words[-1] == '</mem>'


def test_print_episode_shows_mem(memory, capsys):
    cfg, g, _, oracle, _ = memory
    sample.print_episode(oracle[0], g['tok'])
    out = capsys.readouterr().out
    assert out.count('  mem:    ') == len(oracle[0].turns) and 'stop answer' in out


def test_task_id_of_every_kind_of_task(memory):
    """The header of a printed episode names its task: an id attribute, a dict's 'id', or the task
    itself when it is a plain number or string (the example gym's secret used to print 'task None')."""
    _, _, _, oracle, _ = memory
    assert sample._task_id(oracle[0].task) == oracle[0].task.id
    assert sample._task_id({'id': 'q7'}) == 'q7' and sample._task_id(5) == 5 and sample._task_id(object()) is None


def test_episode_advantages_map_rows_back_to_full_sequence(memory):
    """Folded episodes train one row per turn; the sampling log-probs, used as a stand-in advantage,
    must land back on exactly the positions that hold them in the full sequence."""
    cfg, g, _, _, sampled = memory
    batch = collate(sampled, g['fmt'].pad_id)
    assert len(batch['ids']) > len(sampled)  # really folded
    adv = report.episode_advantages(sampled, batch, batch['sample_logp'])
    for a, t in zip(adv, sampled):
        assert torch.equal(a, t.sample_logp * t.action_mask)


def test_html_with_advantages(memory):
    cfg, g, _, _, sampled = memory
    adv = [torch.linspace(-1, 1, len(t.ids) - 1) * t.action_mask for t in sampled]
    for cells, t, a in zip(parse(sample.render_html(sampled, g['tok'], adv)).episodes, sampled, adv):
        check_cells(cells, t, g['tok'])
        assert 'data-adv' not in cells[0][0]
        for j, (attrs, _) in enumerate(cells[1:], 1):
            assert float(attrs['data-adv']) == pytest.approx(float(a[j - 1]), abs=1e-5)


def test_cli_checkpoint_and_rollout_dump(memory, tmp_path, capsys):
    cfg, g, model, _, sampled = memory
    cfg = dict(cfg, out_dir=str(tmp_path), n_layer=1, n_head=2, n_embd=32)
    report.save_checkpoint(dict(model=model.state_dict(), optimizer={}, step=7, config=cfg), str(tmp_path), 7, 1)
    html = tmp_path / 'ep.html'
    sample.main([f'--out_dir={tmp_path}', '--n=2', '--greedy', f'--html={html}'])
    out = capsys.readouterr().out
    assert 'ckpt_000007.pt (step 7)' in out and out.count('=== task') == 2 and html.exists()
    report.save_checkpoint(dict(model=model.state_dict(), optimizer={}, step=9, config=cfg), str(tmp_path), 9, 2)
    sample.main([f'--out_dir={tmp_path}', '--n=1'])  # the newest, unless --ckpt names another
    assert f'policy: {tmp_path / "ckpt_000009.pt"} (step 9)' in capsys.readouterr().out  # the folder names the run
    sample.main([f'--ckpt={tmp_path / "ckpt_000007.pt"}', '--n=1'])  # its own config: no --out_dir needed
    assert f'policy: {tmp_path / "ckpt_000007.pt"} (step 7)' in capsys.readouterr().out
    batch = collate(sampled, g['fmt'].pad_id)
    dump = report.dump_rollout(str(tmp_path / 'rollout.pt'), sampled, batch, batch['sample_logp'], cfg, 7)
    sample.main([f'--metrics_rollout={dump}', f'--html={html}'])
    assert 'step 7, 3 episodes' in capsys.readouterr().out
    (tmp_path / 'other.yaml').write_text('gym: bugfix\n')  # a YAML naming another gym: the hint names the file
    for flag, trained in (('--gym=bugfix', "gym 'memory'"), ('--model=tiny-qwen3', "model 'tiny'"),
                          (str(tmp_path / 'other.yaml'), "gym 'memory'")):
        with pytest.raises(SystemExit) as e:  # the weights belong to the run's gym and model
            sample.main([f'--out_dir={tmp_path}', flag])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count('\n') == 1 and f'was trained with {trained}, not' in err, err
        assert f'(drop {flag}:' in err and '--untrained' not in err, err  # not a hint that loops
    cells = parse(html.read_text()).episodes
    assert len(cells) == 3 and all('data-adv' in a for a, _ in cells[0][1:])


# -----------------------------------------------------------------------------
# curves, external loggers, summary


def write_metrics(path):
    lines = [dict(step=0, eval_success_rate=0.1, eval_greedy_success=0.2, eval_baseline_tester=0.8,
                  eval_baseline_random_calls=0.05)]
    for s in range(1, 11):
        lines.append(dict(step=s, reward_mean=s / 10, success_rate=s / 20, kl=None, entropy=2 - s / 10,
                          clip_frac=0.01 * s, truncation_rate=0.5 / s, logp_gap_max=0.0 if s == 3 else 1e-7,
                          turns_mean=4.0, tokens_per_s=1000.0, step_time_s=2.0))
    lines[5].update(eval_success_rate=0.4, eval_greedy_success=0.5, eval_pt=40.0, eval_tt=300.0, pt=38.0, tt=290.0)
    lines[10].update(eval_success_rate=0.3, eval_greedy_success=0.6)
    path.write_text(''.join(json.dumps(l) + '\n' for l in lines) + '{"step": 11, "rew')  # killed mid-line


def test_plot_metrics_writes_png(tmp_path):
    pytest.importorskip('matplotlib')
    write_metrics(tmp_path / 'metrics.jsonl')
    png = tmp_path / 'curves.png'
    assert report.plot_metrics(str(tmp_path / 'metrics.jsonl'), str(png)) == str(png)
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 10_000


def test_plot_metrics_without_matplotlib(tmp_path, monkeypatch, capsys):
    write_metrics(tmp_path / 'metrics.jsonl')
    monkeypatch.setitem(sys.modules, 'matplotlib.figure', None)  # import now raises ImportError
    monkeypatch.setattr(report, '_NOTICES', set())
    assert report.plot_metrics(str(tmp_path / 'metrics.jsonl'), str(tmp_path / 'c.png')) is None
    assert report.plot_metrics(str(tmp_path / 'metrics.jsonl'), str(tmp_path / 'c.png')) is None  # next eval
    assert capsys.readouterr().out.count('matplotlib is not installed') == 1 and not (tmp_path / 'c.png').exists()


def test_run_summary_mentions_paths_and_best_score(tmp_path):
    write_metrics(tmp_path / 'metrics.jsonl')
    (tmp_path / 'ckpt_000010.pt').write_bytes(b'')
    (tmp_path / report.CURVES).write_bytes(b'')
    s = report.run_summary(str(tmp_path), dict(train.config, steps=10), 125.0)
    assert f"{tmp_path / 'ckpt_000010.pt'}" in s and f"{tmp_path / 'metrics.jsonl'}" in s
    assert f"{tmp_path / report.CURVES}" in s and f"--html={tmp_path / report.EPISODES}" in s
    assert 'steps        10 / 10' in s and '2m 5s' in s and '0.02M processed' in s
    assert 'eval_success_rate    0.400 at step 5' in s and 'eval_greedy_success  0.600 at step 10' in s
    (tmp_path / 'ckpt_000099.pt').write_bytes(b'garbage')  # a stray file named after a later step
    s = report.run_summary(str(tmp_path), dict(train.config, steps=10), 125.0)
    assert f"{tmp_path / 'ckpt_000010.pt'}" in s and 'ckpt_000099' not in s


def test_run_summary_counts_a_small_runs_tokens_without_rounding_them_to_zero(tmp_path):
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(dict(step=s, tokens=40)) + '\n' for s in range(4)))
    s = report.run_summary(str(tmp_path), dict(train.config, steps=3), 1.0)
    assert 'tokens       120 processed' in s, s  # step 0 (evaluation only) is not counted
    assert 'peak memory' not in s  # no step measured it (not Linux, or an older run)


def test_run_summary_reports_the_largest_steps_peak_memory(tmp_path):
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(dict(step=s, tokens=40, peak_memory_gb=g)) + '\n'
                                                    for s, g in [(1, 2.5), (2, 7.25), (3, None)]))
    assert 'peak memory  7.2 GB' in report.run_summary(str(tmp_path), dict(train.config, steps=3), 1.0)


def test_run_summary_totals_invalid_episodes_only_when_there_are_some(tmp_path):
    rows = [dict(step=0, eval_invalid_episodes=1, eval_val_invalid_episodes=1, eval_greedy_invalid_episodes=1),
            dict(step=1, tokens=40, invalid_episodes=3),
            dict(step=2, tokens=40, invalid_episodes=0)]
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    s = report.run_summary(str(tmp_path), dict(train.config, steps=2), 1.0)
    assert '  invalid      3 RL episode(s) (left out of the update), 3 evaluation episode(s) (greedy and sampled' in s, s
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps({k: 0 if 'invalid' in k else v for k, v in r.items()}) + '\n'
                                                    for r in rows))
    assert '  invalid ' not in report.run_summary(str(tmp_path), dict(train.config, steps=2), 1.0)


@pytest.mark.parametrize('spare, n_rl, says', [(1, 10, ''), (0, 10, ' (RL with 0 spare turn(s))'),
                                               (2, 6, ' (6 for RL with 2 spare turn(s))'), (1, 6, ' (6 for RL)')])
def test_setup_line_says_what_rl_draws_and_its_spare_turns(capsys, spare, n_rl, says):
    gym_ = dict(train_tasks=[0] * 10, rl_tasks=[0] * n_rl, eval_tasks=[0] * 4)
    report.print_setup(dict(train.config, gym='memory', rl_spare_turns=spare), gym_, torch.nn.Linear(2, 2), 1.0, 1)
    assert f'gym memory: 10 train{says} / 4 held-out tasks' in capsys.readouterr().out


def test_log_external_is_a_no_op_unless_asked(tmp_path):
    report.log_external(dict(train.config, out_dir=str(tmp_path)), dict(step=1, reward_mean=0.5), 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize('script, args, needle', [
    ('sample.py', ['--out_dir=/nonexistent/run'], "no such folder: /nonexistent/run (--out_dir names a run's folder; train first, or add --untrained or --scripted)"),
    ('sample.py', ['--eval', '--out_dir=/nonexistent/run'], "no such folder: /nonexistent/run (--out_dir names a run's folder; train first, or add --untrained or --scripted)"),
    ('sample.py', ['--eval', '--sampled', '--eval_samples=0', '--untrained'], "config key 'eval_samples' must be >= 1, got 0"),
    ('sample.py', ['--eval', '--sampled', '--samples=4', '--untrained'], "--samples: --sampled rolls out the config's eval_samples"),
    ('sample.py', ['--eval', '--ckpt=tests'], '--ckpt=tests is a folder: --out_dir=tests runs its newest checkpoint'),
    ('sample.py', ['--metrics_rollout=/nonexistent/r.pt'], 'no rollout dump /nonexistent/r.pt'),
    ('sample.py', ['--metrics_rollout=README.md'], '--metrics_rollout=README.md is not a rollout dump'),
    ('sample.py', ['--curves=c.png', '--out_dir=/nonexistent/run', '--untrained'], '--curves: no metrics.jsonl'),
    ('sample.py', ['--n=0', '--untrained'], '--n must be >= 1, got 0'),
    ('sample.py', ['--eval', '--show=-1', '--untrained'], '--show must be >= 0, got -1'),
    ('sample.py', ['--sampled', '--untrained'], '--sampled is an --eval flag; add --eval (--greedy is the episodes'),
    ('sample.py', ['--html=/nonexistent/dir/x.html', '--untrained'], 'folder /nonexistent/dir does not exist'),
    ('sample.py', ['--html=tests', '--untrained'], '--html=tests: expected a file name ending in .html'),
    ('sample.py', ['--html=tests/ckpt_000002.pt', '--untrained'], 'expected a file name ending in .html'),
    ('sample.py', ['--eval', '--json=config.json', '--untrained'], "config.json is the name of a run's saved config"),
    ('sample.py', ['--curves=c.pdf', '--untrained'], '--curves=c.pdf: expected a file name ending in .png'),
    ('sample.py', ['--eval', '--scripted', '--untrained'], "--scripted runs the gym's scripted policy, not a model: drop --untrained"),
    ('sample.py', ['--metrics_rollout=r.pt', '--n=2'], '--n does nothing with --metrics_rollout: drop one of them'),
    ('sample.py', ['--ckpt=/nonexistent/c.pt'], '--ckpt=/nonexistent/c.pt: no such file'),
    ('sample.py', ['--ckpt=README.md'], '--ckpt=README.md is not a nanoagent checkpoint (UnpicklingError)'),
    ('sample.py', ['--ckpt=README.md', '--untrained'], '--ckpt does nothing with --untrained: drop one of them'),
    ('sample.py', ['--metrics_rollout=r.pt', '--eval'], '--eval does nothing with --metrics_rollout: drop one of them'),
    ('sample.py', ['--eval', '--curves=c.png', '--untrained'], '--curves does nothing with --eval: drop one of them'),
])
def test_cli_mistakes_exit_2_with_one_line(script, args, needle):
    from script_server import run_script  # python script args, forked from a pre-warmed interpreter
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = run_script(script, args, cwd=root, timeout=120)
    assert p.returncode == 2 and p.stderr.count('\n') == 1 and needle in p.stderr, p.stderr


def test_a_config_whose_out_dir_holds_no_run_is_refused_too(tmp_path, capsys):
    """Without --out_dir on the command line (the config's own out_dir), no run there still means no
    quiet untrained policy: one line that says how to ask for one."""
    (tmp_path / 'c.yaml').write_text(f"out_dir: {tmp_path / 'none'}\n")
    with pytest.raises(SystemExit) as e:
        sample.main([str(tmp_path / 'c.yaml')])
    assert e.value.code == 2 and f"no such folder: {tmp_path / 'none'} (--out_dir names a run's folder; train first, or add --untrained or --scripted)" in capsys.readouterr().err
    (tmp_path / 'none').mkdir()  # a folder, but no run in it
    with pytest.raises(SystemExit) as e:
        sample.main([str(tmp_path / 'c.yaml')])
    assert e.value.code == 2 and f"no checkpoint in {tmp_path / 'none'} (add --untrained" in capsys.readouterr().err


def test_untrained_with_a_runs_out_dir_builds_that_runs_gym_and_model(memory, tmp_path, capsys):
    """--untrained --out_dir=<a memory-gym run> used to build the default bugfix gym: it reads the run's
    config.json (its gym, its model sizes), flags still on top."""
    cfg, g, _, _, _ = memory
    json.dump(dict(cfg, out_dir=str(tmp_path), n_layer=1, n_head=2, n_embd=32), open(tmp_path / 'config.json', 'w'))
    got, gym_, model, policy, _ = sample.load_run([f'--out_dir={tmp_path}', '--max_turns=3'], untrained=True)
    assert got['gym'] == 'memory' and got['n_embd'] == 32 and got['max_turns'] == 3 and gym_['fmt'].mem_span
    assert policy == f"untrained tiny (--untrained, the config of {tmp_path / 'config.json'})"
    got, _, _, policy, _ = sample.load_run([f'--out_dir={tmp_path}', '--gym=bugfix'], untrained=True)  # not the run's
    assert policy == 'untrained tiny (--untrained)' and got['gym'] == 'bugfix' and got['n_embd'] != 32
    got, _, _, policy, _ = sample.load_run([f"--out_dir={tmp_path / 'none'}"], untrained=True)  # no run there: the defaults
    assert policy == 'untrained tiny (--untrained)' and got['gym'] == 'bugfix'
    capsys.readouterr()
    json.dump(dict(cfg, out_dir=str(tmp_path), threads=1000), open(tmp_path / 'config.json', 'w'))  # a bigger machine's run
    cores = os.cpu_count()
    assert sample.load_run([f'--out_dir={tmp_path}'], untrained=True)[0]['threads'] == cores  # looked at, not refused
    assert f'note: the run used threads=1000; this machine has {cores} cores, so {cores}' in capsys.readouterr().out
    assert sample.load_run([f'--out_dir={tmp_path}', '--threads=1'], untrained=True)[0]['threads'] == 1  # argv on top


def test_dtype_auto_is_resolved_as_train_py_resolves_it(tmp_path, capsys, monkeypatch):
    # an untrained look at a dtype: auto config used to leave 'auto', which autocast reads as float32
    import config as config_lib
    monkeypatch.setattr(config_lib, 'native_dtype', lambda device: ('bfloat16', 'this CPU has avx512_bf16'))
    got = sample.load_run([f"--out_dir={tmp_path / 'none'}", '--dtype=auto', '--n_layer=1'], untrained=True)[0]
    assert got['dtype'] == 'bfloat16' and 'dtype auto: bfloat16 (this CPU has avx512_bf16)' in capsys.readouterr().out
    assert sample.load_run([f"--out_dir={tmp_path / 'none'}", '--n_layer=1'], untrained=True)[0]['dtype'] == 'float32'


def test_untrained_with_a_damaged_config_json_is_one_line(tmp_path, capsys):
    for text, what in (('{"gym": "mem', 'is not a readable config (JSONDecodeError)'), ('[1, 2]', 'holds a list, not a config (a JSON object)')):
        (tmp_path / 'config.json').write_text(text)
        with pytest.raises(SystemExit) as e:
            sample.main([f'--out_dir={tmp_path}', '--untrained'])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == f"error: {tmp_path / 'config.json'} {what}: fix it or move it away\n"


def test_curves_skip_lines_that_are_not_json_objects(tmp_path):
    (tmp_path / 'metrics.jsonl').write_text('{"step": 0, "eval_success_rate": 0.5}\n5\n[1]\n{"step": 1, "reward_mean": 1.0}\n{"st')
    assert [r['step'] for r in report.read_metrics(tmp_path / 'metrics.jsonl')] == [0, 1]
    sample.main([f'--out_dir={tmp_path}', f'--curves={tmp_path / "c.png"}'])
    assert (tmp_path / 'c.png').stat().st_size > 0


def test_metrics_rollout_of_a_checkpoint_is_one_line(tmp_path, capsys):
    ckpt = tmp_path / 'ckpt_000002.pt'
    torch.save(dict(model={}, step=2), ckpt)  # a checkpoint, not a rollout dump
    with pytest.raises(SystemExit) as e:
        sample.main([f'--metrics_rollout={ckpt}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and 'is not a rollout dump' in err and "KeyError: 'trajs'" in err and err.count('\n') == 1


def test_a_training_key_is_refused_not_ignored(tmp_path, capsys):
    """--steps or --lr on sample.py's command line would change nothing: one line names the key; a
    rollout key (--max_turns) is not refused there."""
    for arg in ('--steps=3', '--lr=0.1', '--resume', '--warmstart_steps=2', '--rl_min_objectives=2'):
        with pytest.raises(SystemExit) as e:
            sample.main([f'--out_dir={tmp_path}', arg])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count('\n') == 1 and f"{arg.partition('=')[0]} is a training key" in err
    with pytest.raises(SystemExit) as e:
        sample.main([f'--out_dir={tmp_path}', '--max_turns=3'])
    assert 'no checkpoint in' in capsys.readouterr().err


def test_only_corrupt_checkpoints_say_so(tmp_path, capsys):
    (tmp_path / 'ckpt_000002.pt').write_bytes(b'not a checkpoint')
    with pytest.raises(SystemExit) as e:
        sample.main([f'--out_dir={tmp_path}'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f'no checkpoint in {tmp_path} loads (all corrupt' in err
    assert (tmp_path / 'ckpt_000002.pt').read_bytes() == b'not a checkpoint'


def test_more_episodes_than_tasks_says_that_tasks_repeat(memory, capsys):
    cfg, g, model, _, _ = memory
    capsys.readouterr()
    assert len(sample.run_episodes(model, g, cfg, 'heldout', 8)) == 8 and 'repeat' not in capsys.readouterr().out
    trajs = sample.run_episodes(model, g, cfg, 'heldout', 10)
    assert len(trajs) == 10 and ('note: --n=10 is more than the 8 heldout tasks, so tasks repeat (each once before any '
                                 'twice)') in capsys.readouterr().out
    ids = [t.task.id for t in trajs]
    assert len(set(ids)) == 8 and ids[8:] == ids[:2]


def test_the_validation_split_can_be_shown_and_evaluated(memory, capsys):
    cfg, g, model, _, _ = memory
    with pytest.raises(SystemExit):
        sample.run_episodes(model, g, cfg, 'val', 2)  # the fixture's gym has no validation tasks
    assert capsys.readouterr().err == 'error: --split=val: the gym has no such tasks (set --val_tasks=N)\n'
    with pytest.raises(SystemExit):  # a gym without the key: no hint it would then refuse
        sample.split_tasks(dict(eval_tasks=[0]), 'val', dict(cfg, gym='example', model='tiny'))
    assert capsys.readouterr().err == "error: --split=val: gym 'example' has no validation split\n"
    gv = load_gym(dict(cfg, val_tasks=3))
    assert [t.id for t in gv['val_tasks']] and not {t.id for t in gv['val_tasks']} & {t.id for t in gv['eval_tasks']}
    numbers, trajs = sample.evaluate(model, gv, cfg, split='val')
    assert numbers['episodes'] == 3 and [t.task.id for t in trajs] == [t.id for t in gv['val_tasks']]


def test_the_training_split_evaluates_eval_tasks_of_its_tasks(memory):
    """--eval --split=train: the first eval_tasks training tasks (thousands otherwise), all when 0."""
    cfg, g, model, _, _ = memory
    numbers, trajs = sample.evaluate(model, g, dict(cfg, eval_tasks=3), split='train')
    assert numbers['episodes'] == 3 and [t.task.id for t in trajs] == [t.id for t in g['train_tasks'][:3]]
    numbers, _ = sample.evaluate(model, g, dict(cfg, eval_tasks=0), split='train')
    assert numbers['episodes'] == len(g['train_tasks']) > 3


def test_scripted_evaluates_the_gyms_warm_start_policy_without_a_model(tmp_path, capsys):
    """--scripted: the warm start's scripted policy through the same rollout, evaluation and metrics: on the
    memory gym (the oracle) it answers every held-out question, and folding keeps the peak context below
    the full history."""
    numbers = sample.main(['config/tiny_mem.yaml', '--eval', '--scripted', '--eval_tasks=12', '--show=0',
                           f'--out_dir={tmp_path}', f'--json={tmp_path / "eval.json"}'])
    out = capsys.readouterr()
    assert out.out.startswith("policy: the memory gym's scripted policy (--scripted)\n")
    assert ', tokens processed per episode (tt) ' in out.out and ', peak context (pt) ' in out.out  # named, not bare tt/pt
    assert '\r' not in out.err  # no progress bar in a stderr that is not a terminal (a log file)
    assert numbers['episodes'] == 12 and numbers['em'] == numbers['success_rate'] == numbers['format_ok'] == 1.0
    assert numbers['truncation_rate'] == 0.0 and numbers['pt_k3'] < numbers['ht_k3'] and numbers['em_k3'] == 1.0
    assert numbers['hop_share'] == 1.0 and out.out.rstrip().splitlines()[-2].endswith(', hop_share 1.000')  # every hop, in order
    assert not os.path.exists(tmp_path / 'config.json')  # a look, not a run
    assert numbers['decoding'] == 'scripted' and numbers['temperature'] is None
    saved = json.loads((tmp_path / 'eval.json').read_text())  # the numbers, and each episode's outcome by task
    assert {k: v for k, v in saved.items() if k != 'per_episode'} == json.loads(json.dumps(numbers))
    tasks = load_gym(train.load_config(['config/tiny_mem.yaml', '--eval_tasks=12']))['eval_tasks']
    assert [e['task'] for e in saved['per_episode']] == [t.id for t in tasks] and len(set(e['task'] for e in saved['per_episode'])) == 12
    assert all(e['success'] and e['em'] == 1.0 and e['stop'] == 'answer' for e in saved['per_episode'])
    assert 'per_episode' not in numbers  # the printed line stays one short JSON object
    sample.main(['config/tiny_mem.yaml', '--eval', '--scripted', '--eval_tasks=4', '--show=0', '--max_turns=1',
                 f'--out_dir={tmp_path}'])  # every episode cut: the line says by which limit
    assert ', truncation_rate 1.000, stop_max_len 0.000, stop_max_turns 1.000, stop_budget 0.000, ' in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a split the gym lacks: refused before the policy line
        sample.main(['config/tiny_mem.yaml', '--eval', '--scripted', '--split=val', f'--out_dir={tmp_path}'])
    out = capsys.readouterr()
    assert out.out == '' and out.err == 'error: --split=val: the gym has no such tasks (set --val_tasks=N)\n'
    sample.main(['config/tiny_mem.yaml', '--scripted', '--n=2', f'--out_dir={tmp_path}'])  # episodes as text too
    out = capsys.readouterr().out
    assert '2 episodes: mean reward' in out and 'success 1.000' in out


def test_eval_of_a_checkpoint_prints_the_numbers_its_run_logged(tmp_path, capsys):
    """sample.py --eval on step 7's checkpoint gives what train.evaluate logged at step 7: greedy and
    sampled (the run's eval_samples), held-out and validation. The same generator (rollout.eval_generator)
    and the same batches; sampled token counts differ under any other seeding."""
    cfg = train.load_config(['config/tiny_mem.yaml', '--train_tasks=16', '--eval_tasks=6', '--val_tasks=5',
                             '--eval_samples=3', '--n_layer=1', '--n_head=2', '--n_embd=32', '--dtype=float32',
                             '--device=cpu', f'--out_dir={tmp_path}'])
    gym_ = load_gym(cfg, None, train.config)
    torch.manual_seed(0)
    model = train.load_policy(cfg, gym_['tok'].vocab_size)
    logged = train.evaluate(model, gym_, cfg, 7)
    report.save_checkpoint(dict(model=model.state_dict(), optimizer={}, step=7, config=cfg), str(tmp_path), 7, 1)
    ckpt = f'--ckpt={tmp_path / "ckpt_000007.pt"}'
    for split, prefix in (('heldout', 'eval_'), ('val', 'eval_val_')):
        greedy = sample.main([ckpt, '--eval', f'--split={split}', '--show=0'])
        assert greedy['step'] == 7 and greedy['success_rate'] == logged[prefix + 'greedy_success'] and greedy['samples'] == 1
        sampled = sample.main([ckpt, '--eval', f'--split={split}', '--show=0', '--sampled'])  # the run's eval_samples
        shared = [k for k in sampled if prefix + k in logged]
        assert sampled['samples'] == 3 and {'tt', 'pt', 'reward_mean', 'success_rate', 'turn_format_ok'} <= set(shared), shared
        assert {k: sampled[k] for k in shared} == {k: logged[prefix + k] for k in shared}
    capsys.readouterr()


def test_eval_of_a_checkpoint_prints_what_its_run_logged_and_what_differs(tmp_path, capsys):
    """Beside its own numbers, sample.py --eval of a checkpoint prints the ones its run logged at that
    step (metrics.jsonl): 'the same' when they are; else the settings that differ from the run's
    evaluation; and a note when the run did not evaluate that step."""
    cfg = train.load_config(['config/tiny_mem.yaml', '--train_tasks=16', '--eval_tasks=6', '--eval_samples=3',
                             '--n_layer=1', '--n_head=2', '--n_embd=32', '--dtype=float32', '--device=cpu',
                             f'--out_dir={tmp_path}'])
    gym_ = load_gym(cfg, None, train.config)
    torch.manual_seed(0)
    model = train.load_policy(cfg, gym_['tok'].vocab_size)
    logged = train.evaluate(model, gym_, cfg, 7)
    (tmp_path / 'metrics.jsonl').write_text(json.dumps(dict(step=7, **logged)) + '\n')
    for step in (5, 7):  # step 7 as a resumed run saves it: resume is how it started, not how it evaluates
        report.save_checkpoint(dict(model=model.state_dict(), optimizer={}, step=step, config=dict(cfg, resume=step == 7)),
                               str(tmp_path), step, 5)
    ckpt = f'--ckpt={tmp_path / "ckpt_000007.pt"}'
    capsys.readouterr()
    same = sample.main([ckpt, '--eval', '--show=0', '--sampled'])['logged']
    assert same['numbers']['tt'] == logged['eval_tt'] and same['same'] and same['differs_in'] == []
    assert 'the run logged at step 7: ' in capsys.readouterr().out
    greedy = sample.main([ckpt, '--eval', '--show=0'])['logged']
    assert greedy['numbers'] == {'success_rate' + k[len('eval_greedy_success'):]: v for k, v in logged.items()
                                 if k.startswith('eval_greedy_success')} | {'invalid_episodes': 0} and greedy['same']
    assert set(greedy['numbers']) == {'success_rate', *(f'success_rate_k{k}' for k in range(1, 5)), 'invalid_episodes'}  # by parts too
    assert capsys.readouterr().out.rstrip().splitlines()[-2].endswith(': the same')
    other = sample.main([ckpt, '--eval', '--show=0', '--sampled', '--batch=2', '--temperature=0.7'])
    line = capsys.readouterr().out.splitlines()[-2]
    assert other['tt'] != logged['eval_tt'] and not other['logged']['same'] and 'not the same' in line, line
    assert 'temperature 1.0 -> 0.7' in line and 'batch 512 -> 2' in line, line
    cold = sample.main([ckpt, '--eval', '--show=0', '--temperature=0.7', '--eval_samples=5'])['logged']
    assert cold['same'] and cold['differs_in'] == [], cold  # greedy reads neither
    assert capsys.readouterr().out.rstrip().splitlines()[-2].endswith(': the same')
    fewer = sample.main([ckpt, '--eval', '--show=0', '--max_turns=4'])  # equal success, other settings: both said
    line = capsys.readouterr().out.splitlines()[-2]
    assert line.endswith(': the same, though this evaluation differs in: max_turns 17 -> 4') and fewer['logged']['differs_in'], line
    (tmp_path / 'train.yaml').write_text('steps: 99\nbatch_size: 5\noracle_detour: 0.5\n')  # read by training only
    yaml_keys = sample.main([ckpt, str(tmp_path / 'train.yaml'), '--eval', '--show=0', '--sampled'])['logged']
    assert yaml_keys['same'] and yaml_keys['differs_in'] == [], yaml_keys
    for args, why in (([f'--ckpt={tmp_path / "ckpt_000005.pt"}'], 'no evaluation of this split at step 5'),
                      ([ckpt, '--split=train'], 'train.py does not evaluate the training split'),
                      ([ckpt, '--split=val', '--val_tasks=2'], 'the run had no validation tasks (val_tasks 0)')):
        assert why in sample.main(args + ['--eval', '--show=0'])['logged']['missing']
        assert 'note: nothing logged to compare with: ' in capsys.readouterr().out
    old_names = dict({k: v for k, v in logged.items() if not k.startswith('eval_stop_')},  # stop names before 3fc0302
                     eval_stop_truncated=0.0, eval_stop_max_turns=0.5, eval_stop_budget=0.0)
    (tmp_path / 'metrics.jsonl').write_text(json.dumps(dict(step=7, **dict(logged, eval_invalid_episodes=1))) + '\n')
    edited = sample.main([ckpt, '--eval', '--show=0', '--sampled'])  # an edited count: said as a count
    line = capsys.readouterr().out.splitlines()[-2]
    assert not edited['logged']['same'] and ': invalid_episodes 1 (here 0): not the same' in line, line
    (tmp_path / 'metrics.jsonl').write_text(json.dumps(dict(step=7, **dict(logged, eval_greedy_invalid_episodes=2))) + '\n')
    edited = sample.main([ckpt, '--eval', '--show=0'])  # greedy: its own logged count
    line = capsys.readouterr().out.splitlines()[-2]
    assert not edited['logged']['same'] and ': invalid_episodes 2 (here 0): not the same' in line, line
    (tmp_path / 'metrics.jsonl').write_text(json.dumps(dict(step=7, **dict(logged, eval_greedy_invalid_episodes=0))) + '\n')
    sample.main([ckpt, '--eval', '--show=0'])
    assert 'invalid_episodes' not in capsys.readouterr().out.splitlines()[-2]  # none: not said
    older = {k: v for k, v in logged.items() if k != 'eval_greedy_invalid_episodes'}  # a log from before the count
    (tmp_path / 'metrics.jsonl').write_text(json.dumps(dict(step=7, **older)) + '\n')
    before = sample.main([ckpt, '--eval', '--show=0'])['logged']
    assert before['same'] and 'invalid_episodes' not in before['numbers'], before
    (tmp_path / 'metrics.jsonl').write_text(json.dumps(dict(step=7, **old_names)) + '\n')
    old = sample.main([ckpt, '--eval', '--show=0', '--sampled'])['logged']
    assert old['same'] and 'tt' in old['numbers'] and not any(k.startswith('stop_') for k in old['numbers']), old
    (tmp_path / 'metrics.jsonl').unlink()
    assert 'no metrics.jsonl beside' in sample.main([ckpt, '--eval', '--show=0'])['logged']['missing']


def test_out_dir_beside_a_checkpoint_file_is_refused(tmp_path, capsys):
    """--ckpt names the checkpoint and so its run: an --out_dir beside it would be ignored."""
    (tmp_path / 'ckpt_000001.pt').write_bytes(b'x')
    with pytest.raises(SystemExit) as e:
        sample.main([f'--ckpt={tmp_path / "ckpt_000001.pt"}', '--out_dir=out/elsewhere', '--eval'])
    assert e.value.code == 2 and '--out_dir does nothing with --ckpt' in capsys.readouterr().err


@pytest.mark.parametrize('processes', [1, 2])
def test_a_checkpoint_of_a_run_on_several_processes_says_its_sampled_numbers_differ(memory, tmp_path, capsys, processes):
    """train.py saves every rank's sampler; a run on several processes evaluated a share of the tasks on
    each, which sample.py (one process) cannot repeat: it says so, and only then."""
    cfg, _, model, _, _ = memory
    cfg = dict(cfg, out_dir=str(tmp_path), n_layer=1, n_head=2, n_embd=32)
    gens = [torch.Generator().get_state()] * processes
    report.save_checkpoint(dict(model=model.state_dict(), optimizer={}, step=3, config=cfg, rng=dict(gen=gens)),
                           str(tmp_path), 3, 1)
    sample.main([f'--out_dir={tmp_path}', '--n=1'])
    assert ('comes from a run on 2 processes' in capsys.readouterr().out) == (processes == 2)


def test_a_closed_pipe_ends_sample_quietly():
    """`python sample.py ... | head -1`: the reader goes away, sample.py ends without a traceback."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, 'sample.py', '--untrained', '--n=2'], cwd=root, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, HF_HUB_OFFLINE='1'))
    p.stdout.close()  # as head does once it has its lines: every later write meets a closed pipe
    err = p.stderr.read()
    p.wait(timeout=120)
    assert 'BrokenPipeError' not in err and 'Traceback' not in err, err
