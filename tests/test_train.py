"""End-to-end runs of train.py in subprocesses: determinism, resume, SIGKILL, corrupt checkpoints."""
import copy
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from config import config, load_config
from gym import load_gym
from gyms import memory as gm
from model import load_policy, peak_memory_gb, release_memory
import report
from report import MACHINE_KEYS
from rollout import rollout_batch
from script_server import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ['--gym=bugfix', '--train_variants=2', '--warmstart_episodes=16', '--warmstart_steps=10', '--batch_size=2', '--group_size=4',
         '--eval_every=2', '--eval_tasks=4', '--eval_samples=1', '--threads=1', '--n_embd=32', '--max_len=192']


def train(out_dir, *args, check=True, wait=True, small=SMALL):
    cmd = [sys.executable, 'train.py', *small, f'--out_dir={out_dir}', *args]
    env = dict(os.environ, HF_HUB_OFFLINE='1')
    if not wait:  # SIGINT back to its default: a shell's background job (nohup ... &, some CI runners) starts with it
        # ignored, a child inherits that, and Python then installs no KeyboardInterrupt handler at all
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    p = run_script(cmd[1], cmd[2:], cwd=ROOT, env=env, timeout=600)  # python train.py, forked from a warm interpreter
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def metrics(out_dir):
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in MACHINE_KEYS} for line in f]


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp('ref')
    train(out, '--steps=6', '--save_every=1')
    return metrics(out)


# Runs that several tests start from, trained once per module; each test works on its own copy (copy_run),
# so what one test corrupts, resumes or overwrites no other test sees. Every train.py start pays ~5 s of
# imports and the bugfix gym's set-up before its first step, so sharing them is most of test_train's time.
@pytest.fixture(scope='module')
def warm_started(tmp_path_factory):
    """A fresh run with --steps=0: the warm start and the step-0 evaluation, then ckpt_000000 (kl_coef 0)."""
    out = tmp_path_factory.mktemp('steps0')
    train(out, '--steps=0')
    return out


@pytest.fixture(scope='module')
def one_step(tmp_path_factory):
    """A finished 1-step run (kl_coef 0, group_size 4) saving every step: ckpt_000000 and ckpt_000001;
    returns (out_dir, its CompletedProcess)."""
    out = tmp_path_factory.mktemp('steps1')
    return out, train(out, '--steps=1', '--save_every=1')


@pytest.fixture(scope='module')
def four_steps(tmp_path_factory):
    """A 4-step run saving every step and keeping 3 checkpoints (ckpt_000002..4) and the warm start's
    (ckpt_000000): the reference run stopped at step 4, an evaluation step."""
    out = tmp_path_factory.mktemp('steps4')
    train(out, '--steps=4', '--save_every=1', '--keep_checkpoints=3')
    return out


def copy_run(src, dst):
    """The run in src (checkpoints, metrics.jsonl, config.json) copied into dst, as if trained there."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def test_same_seed_same_metrics_on_cpu(reference, tmp_path):
    train(tmp_path, '--steps=6', '--save_every=1')
    assert metrics(tmp_path) == reference
    assert len(reference) == 7 and reference[0]['step'] == 0
    assert {'eval_baseline_any_edit', 'eval_baseline_random_calls', 'eval_baseline_tester'} <= set(reference[0])
    for key in ('reward_mean', 'success_rate', 'truncation_rate', 'logp_gap_max', 'ratio_dev_first_minibatch',
                'clip_frac', 'entropy', 'loss', 'grad_norm'):
        assert key in reference[1]
    assert all(m['logp_gap_max'] <= 1e-5 and m['ratio_dev_first_minibatch'] <= 1e-5 for m in reference[1:])
    if sys.platform == 'linux':  # each RL step logs its own peak memory (a machine number: not compared above)
        with open(tmp_path / 'metrics.jsonl') as f:
            assert all(json.loads(line)['peak_memory_gb'] > 0.05 for line in list(f)[1:])
    ckpt = torch.load(sorted((tmp_path).glob('ckpt_*.pt'))[-1], weights_only=False)
    assert {'model', 'optimizer', 'rng', 'step', 'config'} <= set(ckpt) and ckpt['config']['steps'] == 6


def test_stop_and_resume_logs_the_same_metrics(reference, four_steps, tmp_path):
    copy_run(four_steps, tmp_path)  # stopped at step 4, an eval step, as the reference evaluates there
    with open(tmp_path / 'metrics.jsonl', 'a') as f:
        f.write('{"step": 5, "loss"')  # a line half-written when the run was killed: dropped on resume
    p = train(tmp_path, '--steps=6', '--save_every=1', '--resume=True')
    assert 'resumed from' in p.stdout
    assert metrics(tmp_path) == reference


def test_resume_after_the_warm_start_skips_it_and_logs_the_same_metrics(reference, warm_started, tmp_path):
    copy_run(warm_started, tmp_path)  # the warm start and the step-0 evaluation, then ckpt_000000
    assert [c.name for c in tmp_path.glob('ckpt_*.pt')] == ['ckpt_000000.pt']
    p = train(tmp_path, '--steps=6', '--save_every=1', '--resume=True')
    assert 'resumed from' in p.stdout and 'ckpt_000000.pt' in p.stdout and 'warm start' not in p.stdout
    assert metrics(tmp_path) == reference


def test_evaluating_more_often_changes_no_training_number(reference, tmp_path):
    """Evaluation samples from a generator of its own: a run that evaluates only at the end logs the same
    training metrics, step by step, as one that evaluates every 2 steps (what configs and RESULTS rely on
    when eval_every changes)."""
    train(tmp_path, '--steps=6', '--save_every=1', '--eval_every=0')
    rows = metrics(tmp_path)
    assert [sorted(r for r in m if r.startswith('eval_')) != [] for m in rows] == [True] + [False] * 5 + [True]
    assert [{k: v for k, v in m.items() if not k.startswith('eval_')} for m in rows] == \
           [{k: v for k, v in m.items() if not k.startswith('eval_')} for m in reference]
    assert rows[-1] == reference[-1] and rows[0] == reference[0]
    for m in rows[1:]:  # logged without the memory advantage too (mem_coef 0); no reward, no signal
        assert m['outcome_adv_abs_mean'] >= 0 and (m['reward_mean'] > 0 or m['outcome_adv_abs_mean'] == 0)


def test_resume_with_only_corrupt_checkpoints_stops_and_keeps_them(one_step, tmp_path):
    copy_run(one_step[0], tmp_path)  # ckpt_000000 and ckpt_000001
    ckpts = sorted(tmp_path.glob('ckpt_*.pt'))
    for c in ckpts:
        c.write_bytes(b'not a checkpoint')
    p = train(tmp_path, '--steps=4', '--resume=True', check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        f'error: no checkpoint in {tmp_path} loads (all corrupt, see above); move them away or '
        f'run with --overwrite=True instead of --resume=True to start again')
    assert sorted(tmp_path.glob('ckpt_*.pt')) == ckpts and all(c.read_bytes() == b'not a checkpoint' for c in ckpts)
    torch.save({'model': {}}, ckpts[-1])  # a dict with weights but no step is not ours either (it was a KeyError)
    p = train(tmp_path, '--steps=4', '--resume=True', check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(f'error: no checkpoint in {tmp_path} loads')
    for c in ckpts:  # killed before its first checkpoint: metrics.jsonl alone is nothing to continue from
        c.unlink()
    p = train(tmp_path, '--steps=4', '--resume=True', check=False)
    assert p.returncode == 2 and p.stderr == (f'error: --resume=True: {tmp_path} holds metrics.jsonl but no checkpoint to '
                                              'continue from; --overwrite=True replaces the run, or choose another out_dir\n')


def test_resume_with_another_model_size_names_the_key(one_step, tmp_path):
    copy_run(one_step[0], tmp_path)  # a finished --steps=1 run
    saved = (tmp_path / 'config.json').read_text()
    p = train(tmp_path, '--steps=2', '--resume=True', '--n_embd=64', '--n_head=2', check=False)  # before the set-up
    assert p.returncode == 2 and p.stdout == '' and p.stderr == (
        f"error: --resume=True: {tmp_path} was trained with n_head 4, not 2, n_embd 32, not 64; choose another "
        "out_dir for a new run\n")
    assert (tmp_path / 'config.json').read_text() == saved  # a refused resume leaves the run's config as it was
    p = train(tmp_path, '--steps=1', '--resume=True', '--lr=0.5')  # finished: nothing to train, nothing rewritten
    assert 'resumed from' in p.stdout and (tmp_path / 'config.json').read_text() == saved
    assert 'at step 1: the run is finished (steps=1); --steps=N with a larger N trains it further' in p.stdout
    assert 'goes on' not in p.stderr  # no warning that the run goes on with lr 0.5: it does not go on
    assert "note: --resume=True: the run is finished, so settings other than its checkpoint's change nothing: " in p.stderr
    assert p.stderr.rstrip().endswith('0.5 here') and 'lr ' in p.stderr
    p = run_script('sample.py', [f'--out_dir={tmp_path}', '--n_embd=64', '--n=1'], cwd=ROOT,
                   env=dict(os.environ, HF_HUB_OFFLINE='1'))
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].endswith('does not fit this config: n_embd 32 there, 64 here')
    p = train(tmp_path, '--steps=2', '--resume=True', '--seed=7', check=False)
    assert p.returncode == 2 and p.stderr == (f"error: --resume=True: {tmp_path} was trained with seed 1337, not 7; "
                                              "choose another out_dir for a new run\n")
    p = train(tmp_path, '--steps=2', '--resume=True', '--gym=memory', check=False,
              small=[a for a in SMALL if a != '--train_variants=2'])  # a bugfix key
    assert p.returncode == 2 and p.stderr == (f"error: --resume=True: {tmp_path} was trained with gym 'bugfix', not "
                                              "'memory'; choose another out_dir for a new run\n")
    p = train(tmp_path, '--resume', '--gym=memory', check=False, small=[])  # the gym is the reason, not the defaults' eval_tasks
    assert p.returncode == 2 and p.stderr == (f"error: --resume=True: {tmp_path} was trained with gym 'bugfix', not "
                                              "'memory'; choose another out_dir for a new run\n")
    p = train(tmp_path, '--steps=2', '--resume=True', '--train_generated=4', check=False)  # bugfix's TASK_KEYS: other training words
    assert p.returncode == 2 and p.stderr == (f"error: --resume=True: {tmp_path} was trained with train_generated 0, not 4; "
                                              "choose another out_dir for a new run\n")
    p = train(tmp_path, '--steps=2', '--resume=True', '--seed=7', '--eval_tasks=5', check=False)  # every difference named
    assert p.returncode == 2 and p.stderr == (f"error: --resume=True: {tmp_path} was trained with seed 1337, not 7, "
                                              "eval_tasks 4, not 5; choose another out_dir for a new run\n")


def test_corrupt_checkpoint_falls_back_to_previous(reference, four_steps, tmp_path):
    copy_run(four_steps, tmp_path)  # --steps=4 --save_every=1 --keep_checkpoints=3
    newest = sorted(tmp_path.glob('ckpt_*.pt'))[-1]
    corrupt = newest.read_bytes()[:1000]
    newest.write_bytes(corrupt)  # truncated, as by a full disk
    p = train(tmp_path, '--steps=6', '--save_every=1', '--resume=True')
    assert f'checkpoint {newest} is corrupt' in p.stderr
    assert 'resumed from' in p.stdout and 'ckpt_000003.pt' in p.stdout
    assert metrics(tmp_path) == reference
    # the corrupt file is kept under another name, out of the rotation: the good checkpoints stay
    assert f'{newest} did not load; renamed to ckpt_000004.pt.corrupt' in p.stdout
    assert (tmp_path / 'ckpt_000004.pt.corrupt').read_bytes() == corrupt
    assert sorted(c.name for c in tmp_path.glob('ckpt_*.pt')) == [  # the run's own keep_checkpoints=3, and step 0
        'ckpt_000000.pt', 'ckpt_000004.pt', 'ckpt_000005.pt', 'ckpt_000006.pt']
    (tmp_path / 'ckpt_best.pt').write_bytes(b'mine')  # a user's file of a similar name is never ours to remove
    train(tmp_path, '--steps=1', '--overwrite=True')
    assert (tmp_path / 'ckpt_best.pt').read_bytes() == b'mine'


def test_ctrl_c_prints_one_line_and_keeps_the_files(tmp_path):
    p = train(tmp_path, '--steps=1000', '--save_every=1', wait=False)
    deadline = time.time() + 300
    while not list(tmp_path.glob('ckpt_*.pt')) and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 130 and 'Traceback' not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith('interrupted: what out_dir holds is kept')
    assert list(tmp_path.glob('ckpt_*.pt')) and (tmp_path / 'metrics.jsonl').read_text().startswith('{"step": 0')


def test_missing_loggers_are_named_before_any_training(tmp_path):
    """tensorboard / wandb asked for but not installed: one notice each, before the warm start and the
    step-0 evaluation, and the run goes on logging to metrics.jsonl."""
    if importlib.util.find_spec('wandb') or importlib.util.find_spec('tensorboard'):
        pytest.skip('wandb or tensorboard is installed: the run would use it')
    out = train(tmp_path, '--steps=0', '--tensorboard=True', '--wandb_project=p').stdout
    notices = [out.index(f'log_external: {kind} is not installed') for kind in ('tensorboard', 'wandb')]
    assert max(notices) < out.index('warm start') < out.index('step 0:') and out.count('is not installed') == 2
    assert (tmp_path / 'metrics.jsonl').read_text().startswith('{"step": 0')


def test_group_size_one_warns(one_step, tmp_path):
    p = train(tmp_path, '--steps=1', '--group_size=1', '--kl_type=k1', '--kl_coef=0.1', '--tis_cap=2', '--pack_turns=true')
    assert 'warning: group_size=1: a group of one is its own baseline' in p.stderr
    assert 'note: pack_turns with keep_tool_results=all: each episode is one row already' in p.stderr
    assert 'warning: kl_type=k1 as a loss has zero gradient in expectation' in p.stderr
    assert "note: tis_cap in float32: the sampler's log-probs are already the trainer's" in p.stderr
    p = one_step[1]  # --steps=1 with the default group_size 4 and kl_coef 0
    assert 'warning: group_size' not in p.stderr and 'warning: kl_type' not in p.stderr and 'tis_cap' not in p.stderr
    assert 'pack_turns' not in p.stderr
    copy_run(one_step[0], tmp_path / 'g2')
    p = train(tmp_path / 'g2', '--steps=0', '--resume=True', check=False)  # its checkpoint is at step 1
    assert p.returncode == 2 and p.stderr.strip().endswith('the newest checkpoint is at step 1, past steps=0')


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    """After a resume past a corrupt ckpt_000010, saving step 6 with keep=1 keeps 6 (and the user's
    corrupt file); counting 10 among the kept removed 6 at once, leaving nothing that loads."""
    import report
    (tmp_path / 'ckpt_000010.pt').write_bytes(b'not a checkpoint')
    for step in (5, 6):
        report.save_checkpoint(dict(model={}, step=step, config={}), str(tmp_path), step, 1)
    assert sorted(p.name for p in tmp_path.glob('ckpt_*.pt')) == ['ckpt_000006.pt', 'ckpt_000010.pt']
    assert report.load_latest_checkpoint(str(tmp_path), 'unused')[0]['step'] == 6
    report.save_checkpoint(dict(model={}, step=10, config={}), str(tmp_path), 10, 1)  # this run reaches step 10
    assert [p.name for p in tmp_path.glob('ckpt_*.pt')] == ['ckpt_000010.pt']


def test_pruning_keeps_the_newest_and_the_warm_start(tmp_path):
    """keep=2 over steps 0-5 leaves 4, 5 and 0: the warm start is what RL recipes are compared from."""
    import report
    for step in range(6):
        report.save_checkpoint(dict(model={}, step=step, config={}), str(tmp_path), step, 2)
    assert sorted(p.name for p in tmp_path.glob('ckpt_*.pt')) == ['ckpt_000000.pt', 'ckpt_000004.pt', 'ckpt_000005.pt']


def test_warm_start_batches_whole_episodes(monkeypatch):
    """A folded episode is one row per turn: each warm-start step must hold every row of the episodes
    it draws (drawing single rows gave folding ~1/6 of the targets full history got per step)."""
    import train as T
    assert T.episode_rows(torch.tensor([0, 0, 1, 2, 2, 2]), 4) == [[0, 1], [2], [3, 4, 5], []]
    real, rows = T.sequence_log_probs, []
    monkeypatch.setattr(T, 'sequence_log_probs', lambda m, ids, am, **kw: rows.append(ids.shape[0]) or real(m, ids, am, **kw))
    for keep, full in ((1, False), ('all', False), (1, True), ('all', True)):
        rows.clear()
        cfg = T.load_config(['config/tiny_mem.yaml', f'--keep_tool_results={keep}', '--warmstart_episodes=6', f'--warmstart_full={full}',
                             '--train_tasks=50', '--warmstart_steps=4', '--warmstart_batch_size=3', '--device=cpu'])
        g = load_gym(cfg)
        assert T.warm_start(T.load_policy(cfg, g['tok'].vocab_size), g, cfg, random.Random(0)) > 0
        rng = random.Random(0)  # replay warm_start's draws: 6 tasks, then 3 episodes per step
        tasks = [rng.choice(g['train_tasks']) for _ in range(6)]
        turns = [sum(t.hops) + 1 for t in tasks]  # the oracle searches once per hop, then answers
        want = [sum(turns[rng.randrange(6)] for _ in range(3)) for _ in range(4)]
        # warmstart_full: a folded episode also trains as one full-history row (a no-op without folding)
        assert rows == ([w + 3 * full for w in want] if keep == 1 else [3] * 4)


def test_ppo_ptx_steps_on_the_scripted_episodes_imitation_loss(monkeypatch, capsys):
    """sft_coef (PPO-ptx): with no advantage anywhere, an update given scripted episodes takes exactly
    one step, the one SGD takes on sft_coef x warm_start_loss of sft_batch_size episodes drawn
    with their own rng (the update's draws as without them), and logs that loss (before the step) as
    sft_loss; without scripted episodes it takes none. sft_coef without scripted episodes to draw, or
    on a gym without a scripted policy, is refused before anything runs."""
    import train as T
    cfg = T.load_config(['config/tiny_mem.yaml', '--warmstart_episodes=6', '--train_tasks=20', '--sft_coef=0.5',
                         '--warmstart_batch_size=4', '--sft_batch_size=2', '--mini_batches=2', '--group_size=3',
                         '--batch_size=2', '--grad_clip=0', '--device=cpu'])
    g = load_gym(cfg)
    model = T.load_policy(cfg, g['tok'].vocab_size)
    scripted = T.scripted_episodes(g, cfg, random.Random(0))
    batch = scripted['batch']  # the scripted episodes as an RL batch whose advantages are all 0
    scripted['rng'] = random.Random(1)
    adv = torch.zeros_like(batch['action_mask'])
    n = len(batch['rewards'])
    states = []  # the update's rng after it: scripted episodes are drawn with their own (RL's draws stay)
    for given in (None, scripted):
        m, expected, rng = copy.deepcopy(model), copy.deepcopy(model), random.Random(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)  # SGD: the step shows sft_coef (Adam's first step would not)
        out = T.ppo_update(m, opt, batch, adv, None, cfg, rng, scripted=given)
        states.append(rng.getstate())
        moved = any(not torch.equal(a, b) for a, b in zip(m.parameters(), model.parameters()))
        assert moved == (given is not None) and ('sft_loss' in out) == ('sft_time_s' in out) == (given is not None)
    assert states[0] == states[1]
    T.update_mode(expected)
    loss = T.warm_start_loss(expected, batch, T.draw_episodes(scripted, 2, random.Random(1)), cfg)
    (0.5 * loss).backward()
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    assert out['sft_loss'] == pytest.approx(loss.item(), rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(m.parameters(), expected.parameters()))
    with pytest.raises(SystemExit):
        T.load_config(['config/tiny_mem.yaml', '--sft_coef=0.5', '--warmstart_episodes=0'])
    assert 'warmstart_episodes is 0 (set it > 0, or sft_coef: 0)' in capsys.readouterr().err
    monkeypatch.setattr(gm, 'setup', lambda cfg, vocab=None, real=gm.setup: dict(real(cfg, vocab), warm_policy=None))
    with pytest.raises(SystemExit, match='2'):
        load_gym(cfg)
    assert "config key 'sft_coef' imitates the gym's scripted policy; gym 'memory' has none" in capsys.readouterr().err


def test_memory_gym_run_logs_mempo_metrics_per_objective_count(tmp_path):
    """config/tiny_mem.yaml end to end, shrunk: the MemPO metrics the issue names reach metrics.jsonl."""
    p = train(tmp_path, 'config/tiny_mem.yaml', '--gym=memory', '--warmstart_steps=3', '--warmstart_batch_size=2',
          '--steps=2', '--eval_every=2', '--eval_tasks=10', '--train_tasks=20', '--warmstart_episodes=20', '--n_embd=32', '--val_tasks=3',
          f'--out_dir={tmp_path}', small=[a for a in SMALL if a != '--train_variants=2'])  # a bugfix key
    rows = metrics(tmp_path)
    last = rows[-1]
    assert [r['step'] for r in rows] == [0, 1, 2]
    assert p.stdout.count(', EM k=') == 2  # the evaluation lines of step 0 and step 2
    assert 'gym memory: 20 train / 10 held-out / 3 validation tasks' in p.stdout  # the setup line counts each split
    assert all(0 <= r['eval_val_success'] <= 1 and 'eval_val_greedy_success' in r for r in (rows[0], last))  # --val_tasks
    assert all(r['eval_val_success_rate'] == r['eval_val_success'] and 'eval_val_em_k1' in r for r in (rows[0], last))
    assert f"best eval_val_success     {max(r['eval_val_success'] for r in (rows[0], last)):.3f}" in p.stdout
    assert p.stdout.count(f", format ok {last['eval_format_ok']:.3f} (turns {last['eval_turn_format_ok']:.3f})") >= 1
    for key in ('mem_reward_mean', 'mem_adv_abs_mean', 'outcome_adv_abs_mean', 'mem_tokens_mean', 'tt', 'pt', 'em', 'f1'):
        assert key in rows[1] and rows[1][key] == rows[1][key], key  # present and not NaN
    raw = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    assert raw[1]['mem_reward_time_s'] >= 0  # a machine key
    # where a run's minutes go: warm start and evaluations, and each step's rollout and update within it
    assert raw[0]['warmstart_time_s'] > 0 and raw[0]['eval_time_s'] > 0 and raw[2]['eval_time_s'] > 0
    assert all(0 < r['rollout_time_s'] and 0 < r['update_time_s'] and r['rollout_time_s'] + r['update_time_s'] <= r['step_time_s']
               for r in raw[1:]) and 'eval_time_s' not in raw[1]
    # scripts/mem_reward_check.py on this run: the two P's and their correlations with memory quality
    spec = importlib.util.spec_from_file_location('mem_reward_check', os.path.join(ROOT, 'scripts', 'mem_reward_check.py'))
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    r = check.check(str(tmp_path), n_tasks=4)
    assert r['step'] == 2 and r['turns'] == 0  # a 3-step warm start finds no fact
    assert r['oracle_complete']['lossy'] == 0 < r['oracle_lossy']['lossy']  # scripted episodes: quality is defined
    found = check.check(str(tmp_path), ['--mem_target=found'], n_tasks=4)  # an override scores as that option would:
    assert 0 < found['oracle_complete']['turns'] < r['oracle_complete']['turns']  # turns with nothing found yet drop out
    cfg = load_config(['config/tiny_mem.yaml', '--train_tasks=40', '--eval_tasks=4', '--device=cpu', '--n_embd=32'])
    gym_ = load_gym(cfg, None, config)
    model = load_policy(cfg, gym_['tok'].vocab_size).eval()
    lossy = gm.folded_policy(lambda *a: gm.oracle_policy(*a, forget=True))  # forgets every finished answer but the last
    tasks = [t for t in gym_['train_tasks'] if len(t.golds) >= 3][:6]
    trajs = rollout_batch([gm.folded_policy(gm.oracle_policy)] * 6 + [lossy] * 6, gym_['fmt'],
                          [gym_['make_env']() for _ in range(12)], tasks * 2, cfg)
    r = check.probe(model, gym_, cfg, trajs)
    assert r['turns'] >= 30 and 0 < r['lossy'] < r['turns']  # the lossy oracle's memories lose what is needed
    assert r['reward_std'] > 0 and 0 < r['P_mem'] < 1 and 0 < r['P_full'] < 1 and all(-1 <= r[k] <= 1 for k in ('corr_mem', 'corr_full', 'corr_reward'))
    assert check.pearson([1, 2, 3], [2, 4, 7]) > 0.98 and check.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1)
    ks = sorted(int(k.split('_k')[1]) for k in last if k.startswith('eval_em_k'))
    assert ks and set(ks) <= {1, 2, 3, 4, 5}
    for k in ks:
        assert 0 <= last[f'eval_em_k{k}'] <= 1 and last[f'eval_pt_k{k}'] <= last[f'eval_tt_k{k}']


def test_fresh_run_never_deletes_an_earlier_runs_checkpoints(one_step, tmp_path):
    """A fresh run in an out_dir that holds checkpoints stops with one line and keeps them (it used to
    delete them); --overwrite=True replaces them; the tiny vocabulary is saved in the checkpoint."""
    copy_run(one_step[0], tmp_path)  # --steps=1 --save_every=1
    ckpts = {c: c.read_bytes() for c in tmp_path.glob('ckpt_*.pt')}
    p = train(tmp_path, '--steps=1', check=False)
    assert p.returncode == 2 and p.stderr.count('\n') == 1
    assert 'holds an earlier run (2 checkpoint(s), metrics.jsonl present): --resume=True continues it, --overwrite=True' in p.stderr
    assert {c: c.read_bytes() for c in tmp_path.glob('ckpt_*.pt')} == ckpts
    (tmp_path / 'rollout_000001.pt').write_bytes(b'a dump of the earlier run')
    (tmp_path / 'notes.txt').write_text('mine')
    (tmp_path / 'rollout_best.pt').write_text('mine')  # a user's file, named like a dump but not one train.py writes
    (tmp_path / 'rollout_000009.pt').mkdir()  # a user's folder named like a dump: never removed
    p = train(tmp_path, '--steps=1', '--save_every=1', '--overwrite=True')
    assert (f'overwrite: an earlier run in {tmp_path}: removing 2 checkpoint(s) and 1 rollout dump(s), its metrics.jsonl '
            'is started anew at step 0') in p.stdout
    assert not (tmp_path / 'rollout_000001.pt').exists() and (tmp_path / 'notes.txt').read_text() == 'mine'
    assert (tmp_path / 'rollout_best.pt').read_text() == 'mine' and (tmp_path / 'rollout_000009.pt').is_dir()
    (tmp_path / 'dumps').mkdir()  # an earlier run's dumps alone: a fresh run would mix its own with them
    (tmp_path / 'dumps' / 'rollout_000003.pt').write_bytes(b'a dump')
    p = train(tmp_path / 'dumps', '--steps=1', check=False)
    assert p.returncode == 2 and 'holds an earlier run (0 checkpoint(s), metrics.jsonl absent, 1 rollout dump(s))' in p.stderr
    state = torch.load(sorted(tmp_path.glob('ckpt_*.pt'))[-1], weights_only=False)
    assert state['vocab'][:3] == ['<pad>', '<bos>', '<unk>'] and len(state['vocab']) > 100
    (tmp_path / 'other').mkdir()  # a run killed before its first checkpoint left only its metrics
    (tmp_path / 'other' / 'metrics.jsonl').write_text('{"step": 0}\n')
    p = train(tmp_path / 'other', '--steps=1', check=False)
    assert p.returncode == 2 and 'holds an earlier run (0 checkpoint(s), metrics.jsonl present)' in p.stderr
    assert (tmp_path / 'other' / 'metrics.jsonl').read_text() == '{"step": 0}\n'
    p = train(tmp_path / 'fresh', '--steps=1', '--resume=True', '--save_every=0', check=False)  # a mistyped folder
    assert p.returncode == 2 and p.stderr == (f"error: --resume=True: {tmp_path / 'fresh'} holds no run to continue (no "
                                              f"config.json, no checkpoint); to start one there, name its config: python "
                                              f"train.py config/NAME.yaml --out_dir={tmp_path / 'fresh'}\n")
    assert not (tmp_path / 'fresh').exists()
    p = train(tmp_path / 'fresh', 'config/smoke.yaml', '--steps=1', '--resume=True', '--save_every=0', '--val_tasks=0')
    assert f"--resume=True: no checkpoint in {tmp_path / 'fresh'}, starting from scratch" in p.stdout


def test_fresh_run_keeps_a_users_curves_and_config_but_restarts_its_own(tmp_path):
    """A folder with no run but a curves.png, or a config.json of other settings (a user's files, or
    docs/): a fresh run refused them in one line instead of replacing them. Its own config.json and
    curves.png (a run stopped before its first checkpoint) start again; --overwrite=True replaces both."""
    (tmp_path / 'curves.png').write_bytes(b'mine')
    p = train(tmp_path, '--steps=1', check=False)
    assert p.returncode == 2 and p.stderr == (f'error: {tmp_path} holds curves.png, which this run would replace: '
                                              f'--overwrite=True replaces them, or choose another out_dir\n')
    (tmp_path / 'curves.png').unlink()
    (tmp_path / 'config.json').write_text('{"mine": 1}')
    p = train(tmp_path, '--steps=1', check=False)
    assert p.returncode == 2 and f'{tmp_path} holds config.json, which' in p.stderr
    assert (tmp_path / 'config.json').read_text() == '{"mine": 1}' and sorted(os.listdir(tmp_path)) == ['config.json']
    train(tmp_path / 'own', '--steps=0', '--save_every=0')
    assert (tmp_path / 'own' / 'curves.png').exists()
    for f in (tmp_path / 'own').iterdir():  # as if stopped before its first checkpoint: its config.json and curves
        if f.name not in ('config.json', 'curves.png'):
            f.unlink()
    train(tmp_path / 'own', '--steps=0', '--save_every=0', '--log_every=5')  # log_every: a key that may differ
    (tmp_path / 'curves.png').write_bytes(b'mine')
    train(tmp_path, '--steps=0', '--overwrite=True')
    assert json.loads((tmp_path / 'config.json').read_text())['steps'] == 0


def test_progress_lines_in_a_log_file(tmp_path):
    """stdout/stderr not a terminal: plain progress lines for the warm start and RL, and the step-0
    evaluation line, so a log file shows where the run is."""
    p = train(tmp_path, '--steps=2', '--log_every=1', '--save_every=0')
    out = p.stdout
    assert 'warm start 10/10' in out and 'RL 1/2' in out and 'RL 2/2' in out
    assert 'step 0: held-out success' in out and out.index('step 0: held-out') < out.index('RL 1/2')


def test_reward_quality_corr_pairs_turns_with_their_quality():
    """compute_advantages writes each turn's memory reward into the episode (None where not scored);
    report pairs it with the turn's memory quality over all episodes (of every rank, once gathered)."""
    from types import SimpleNamespace as NS
    import report
    t = NS(reward=0.0, valid=True, info=dict(mem_rewards=[None, 0.1, 0.5, 0.9], mem_quality_turns=[None, 0.0, 0.5, 1.0]))
    u = NS(reward=0.0, valid=True, info=dict(mem_rewards=[None, 0.2], mem_quality_turns=[None, None]))
    eps = [report.summarise(t), report.summarise(u)]
    assert eps[0]['mem_pairs'] == [(0.1, 0.0), (0.5, 0.5), (0.9, 1.0)] and eps[1]['mem_pairs'] == []
    r, q = [0.1, 0.5, 0.9], [0.0, 0.5, 1.0]  # the only turns with both a scored reward and a quality
    mr, mq = sum(r) / 3, sum(q) / 3
    want = sum((a - mr) * (b - mq) for a, b in zip(r, q)) / (
        sum((a - mr) ** 2 for a in r) ** 0.5 * sum((b - mq) ** 2 for b in q) ** 0.5)
    assert abs(report.episode_metrics(eps)['mem_reward_quality_corr'] - want) < 1e-12
    assert report.quality_corr([(-a, b) for a, b in eps[0]['mem_pairs']], 'c')['c'] < -0.99
    assert report.quality_corr([], 'c') == {} and report.quality_corr([(1.0, 0.5)] * 3, 'c') == {}  # none, constant
    assert 'mem_reward_quality_corr' not in report.episode_metrics([report.summarise(NS(reward=0.0, valid=True, info={}))])


def test_reward_nonzero_is_the_share_of_episodes_with_any_reward():
    from types import SimpleNamespace as NS
    import report
    eps = [report.summarise(NS(reward=r, valid=True, info={})) for r in (0.0, 0.25, 0.0, -1.0)]
    m = report.episode_metrics(eps, 'eval_')
    assert m['eval_reward_nonzero'] == 0.5 and m['eval_reward_mean'] == -0.1875


def test_truncation_is_logged_by_limit_and_by_k():
    """Which limit cut an episode (gym.TRUNCATED: the rollout's max_len or max_turns, or the gym's own
    budget), and truncation per objective count k on memory gyms: what a recipe aimed at long
    questions needs to read."""
    from types import SimpleNamespace as NS
    import report
    stops = [('answer', 1), ('budget', 3), ('max_turns', 3), ('budget', 3), ('answer', 2)]
    eps = [report.summarise(NS(reward=0.0, valid=True, info=dict(stop=s, k=k, em=0.0))) for s, k in stops]
    m = report.episode_metrics(eps, 'eval_val_')
    assert (m['eval_val_truncation_rate'], m['eval_val_stop_budget'], m['eval_val_stop_max_turns']) == (0.6, 0.4, 0.2)
    assert m['eval_val_stop_max_len'] == 0.0 and 'eval_val_stop_truncated' not in m
    assert (m['eval_val_truncation_rate_k1'], m['eval_val_truncation_rate_k2'], m['eval_val_truncation_rate_k3']) == (0, 0, 1)


def test_greedy_success_is_logged_by_number_of_parts(monkeypatch):
    """evaluate() logs eval_greedy_success_k{k} (and the sampled eval_success_rate_k{k}) on the memory gym:
    each the share of that k's greedy episodes that succeeded, checked against the episodes themselves
    (a lossy oracle plays, so success differs by k)."""
    import train
    cfg = load_config(['config/tiny_mem.yaml', '--train_tasks=20', '--eval_tasks=30', '--eval_samples=1', '--device=cpu',
                       '--n_embd=32', '--oracle_forget=0.5'])
    gym_ = load_gym(cfg, None, config)
    rollouts, run_tasks = [], train.run_tasks

    def oracle(model, gym_, cfg, tasks, reps, **kw):
        policies = [gym_['warm_policy'](random.Random(i)) for i in range(len(tasks) * reps)]
        rollouts.append(run_tasks(policies, gym_, cfg, [t for t in tasks for _ in range(reps)]))
        return rollouts[-1]
    monkeypatch.setattr(train, 'run_tasks', oracle)
    m = train.evaluate(None, gym_, cfg, 0)
    greedy = [(len(t.task.golds), t.info['success']) for t in rollouts[0]]
    ks = sorted({k for k, _ in greedy})
    assert ks == [1, 2, 3, 4, 5] and len({m[f'eval_greedy_success_k{k}'] for k in ks}) > 1
    for k in ks:
        won = [s for kk, s in greedy if kk == k]
        assert m[f'eval_greedy_success_k{k}'] == sum(won) / len(won)
        assert f'eval_success_rate_k{k}' in m
    assert m['eval_greedy_success'] == sum(s for _, s in greedy) / len(greedy)


def test_an_episode_the_rollout_cut_counts_at_its_tasks_k():
    # the rollout's own cut (max_len, its turn cap) ends an episode with info {} (or a mid-episode step's
    # info): it used to land in k = 1 and, first in a batch, to drop every EM metric of the step
    from types import SimpleNamespace as NS
    import report
    two, one = NS(golds=[['arvenia'], ['bo']]), NS(golds=[['x']])
    eps = [report.summarise(NS(reward=0.0, valid=True, task=two, info=dict(stop='max_len'))),
           report.summarise(NS(reward=2.0, valid=True, task=two, info=dict(stop='answer', k=2, em=1.0, f1=1.0))),
           report.summarise(NS(reward=1.0, valid=True, task=one, info=dict(stop='answer', k=1, em=1.0, f1=1.0)))]
    assert eps[0]['k'] == 2 and eps[0]['em'] == 0.0
    m = report.episode_metrics(eps, 'eval_')
    assert (m['eval_em'], m['eval_em_k1'], m['eval_em_k2']) == (2 / 3, 1.0, 0.5)
    assert (m['eval_truncation_rate_k1'], m['eval_truncation_rate_k2']) == (0.0, 0.5)
    assert 'k' not in report.summarise(NS(reward=0.0, valid=True, task=7, info={}))  # a task without golds: no k


def test_memory_quality_reaches_the_episode_metrics():
    """env info -> Trajectory -> summarise -> episode_metrics, per k, through the rollout: the lossy
    oracle forgets every answer but the last, so quality is 1 at k = 1 and below 1 at k >= 2."""
    import report
    from gyms import memory as gm
    from rollout import run_tasks
    cfg = load_config(['config/tiny_mem.yaml', '--train_tasks=40', '--eval_tasks=40', '--device=cpu'])
    g = load_gym(cfg)
    tasks = g['train_tasks'][:40]
    for p, check in [(0.0, lambda m, k: m == 1.0), (1.0, lambda m, k: (m == 1.0) == (k == 1))]:
        trajs = run_tasks([gm.folded_policy(gm.make_lossy_oracle(random.Random(0), p)) for _ in tasks], g, cfg, tasks)
        m = report.episode_metrics([report.summarise(t) for t in trajs])
        ks = [int(k.split('_k')[1]) for k in m if k.startswith('mem_quality_k')]
        assert ks and 1 in ks and max(ks) >= 2 and 0 <= m['mem_quality'] <= 1
        assert all(check(m[f'mem_quality_k{k}'], k) for k in ks), m


def test_learning_rate_warms_up_then_stays_or_decays_to_min_lr():
    from train import learning_rate
    cfg = dict(lr=1e-3, warmup_steps=5, steps=105, min_lr=-1.0)
    assert [learning_rate(s, cfg) for s in (1, 5, 50, 105)] == [2e-4, 1e-3, 1e-3, 1e-3]  # constant after warm-up
    cfg['min_lr'] = 1e-4
    lrs = [learning_rate(s, cfg) for s in range(1, 106)]
    assert lrs[:5] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])  # the same warm-up
    assert lrs[54] == pytest.approx(5.5e-4) and lrs[-1] == pytest.approx(1e-4)  # half-way down at the middle, min_lr last
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # never rises after the warm-up


def test_evaluation_rolls_out_a_bounded_number_of_episodes_at_once(monkeypatch):
    """Many held-out tasks (--eval_tasks=100000 on a generated gym) are rolled out in batches of at most
    EVAL_EPISODES_PER_BATCH episodes, not all at once; greedy numbers do not depend on the batching."""
    import train
    cfg = load_config(['config/tiny_mem.yaml', '--train_tasks=20', '--eval_tasks=10', '--eval_samples=2', '--device=cpu',
                       '--n_embd=32', '--max_turns=4'])
    gym_ = load_gym(cfg, None, config)
    torch.manual_seed(0)
    model = load_policy(cfg, gym_['tok'].vocab_size).eval()
    sizes, run_tasks = [], train.run_tasks

    def spy(model, gym_, cfg, tasks, reps, **kw):
        sizes.append(len(tasks) * reps)
        return run_tasks(model, gym_, cfg, tasks, reps, **kw)
    monkeypatch.setattr(train, 'run_tasks', spy)
    whole = train.evaluate(model, gym_, cfg, 0)
    assert sizes == [10, 20]  # one batch each for greedy and sampled
    sizes.clear()
    monkeypatch.setattr(train, 'EVAL_EPISODES_PER_BATCH', 3)
    batched = train.evaluate(model, gym_, cfg, 0)
    assert max(sizes) <= 3 and sum(sizes) == 30
    assert batched['eval_greedy_success'] == whole['eval_greedy_success']
    assert {k for k in batched} == {k for k in whole}


def test_resume_adding_a_kl_term(warm_started, one_step, tmp_path):
    """From ckpt_000000 of a run without a KL term, --kl_coef>0 takes the loaded (warm-started) weights as
    the reference, as a fresh run would; from a later checkpoint it is one line (no reference saved)."""
    copy_run(warm_started, tmp_path)  # --steps=0 with kl_coef 0 (the default)
    p = train(tmp_path, '--steps=1', '--kl_coef=0.1', '--resume=True')
    assert 'resumed from' in p.stdout and metrics(tmp_path)[-1]['kl'] == 0.0  # first step: policy == reference
    copy_run(one_step[0], tmp_path / 'b')  # --steps=1 with kl_coef 0
    p = train(tmp_path / 'b', '--steps=2', '--kl_coef=0.1', '--resume=True', check=False)
    assert p.returncode == 2 and 'has no KL reference (its run had kl_coef 0)' in p.stderr
    assert 'copy its ckpt_000000.pt into a new out_dir and resume there' in p.stderr
    (tmp_path / 'c').mkdir()  # what the message says works
    shutil.copy(tmp_path / 'b' / 'ckpt_000000.pt', tmp_path / 'c' / 'ckpt_000000.pt')
    p = train(tmp_path / 'c', '--steps=1', '--kl_coef=0.1', '--resume=True')
    assert 'resumed from' in p.stdout and metrics(tmp_path / 'c')[-1]['kl'] == 0.0


def test_an_evaluation_where_every_episode_is_invalid_stops(capsys):
    import train
    cfg = load_config(['config/tiny_mem.yaml', '--train_tasks=20', '--eval_tasks=4', '--device=cpu', '--n_embd=32'])
    gym_ = load_gym(cfg, None, config)
    model = load_policy(cfg, gym_['tok'].vocab_size).eval()

    class Broken(gm.MemoryEnv):
        def step(self, action_text, finish='stop'):
            raise RuntimeError('tool down')
    with pytest.raises(SystemExit) as e:
        train.evaluate(model, dict(gym_, make_env=Broken), cfg, 0)
    assert e.value.code == 2 and 'evaluation (held-out, greedy): every episode is invalid; the first: RuntimeError: tool down' in capsys.readouterr().err


def test_an_evaluation_warns_once_for_each_split_and_decoding(monkeypatch, capsys):
    """A gym that breaks on some tasks of both splits: each evaluation's warning names its split and
    decoding, so a validation break after a held-out one is still said; evaluating again says nothing new."""
    import train
    cfg = load_config(['config/tiny_mem.yaml', '--train_tasks=20', '--eval_tasks=4', '--val_tasks=4', '--device=cpu', '--n_embd=32'])
    gym_ = load_gym(cfg, None, config)
    model = load_policy(cfg, gym_['tok'].vocab_size).eval()

    class Flaky(gm.MemoryEnv):  # the first task of each split breaks
        def step(self, action_text, finish='stop'):
            if self.task.id.endswith('-0'):
                raise RuntimeError('tool down')
            return super().step(action_text, finish)
    monkeypatch.setattr(report, '_WARNED', set())
    for step in (0, 1):
        out = train.evaluate(model, dict(gym_, make_env=Flaky), cfg, step)
    err = capsys.readouterr().err.splitlines()
    assert sorted(line.split(':')[1] for line in err) == sorted(
        [' evaluation (held-out, greedy)', ' evaluation (held-out, sampled)', ' evaluation (validation, greedy)',
         ' evaluation (validation, sampled)']), err
    assert out['eval_invalid_episodes'] == cfg['eval_samples'] == out['eval_val_invalid_episodes']
    assert out['eval_greedy_invalid_episodes'] == 1 == out['eval_val_greedy_invalid_episodes']  # one greedy episode a task


def test_format_metrics_count_malformed_turns_and_episodes():
    """turn_format_ok = 1 - malformed turns / turns and format_ok = episodes ending well formed, from the
    env's info through the rollout: the oracle scores 1 and 1; one malformed first turn per episode
    (then the oracle) lowers the first by exactly one turn per episode and the second to 0."""
    import report
    from gyms import memory as gm
    from rollout import run_tasks
    cfg = load_config(['config/tiny_mem.yaml', '--train_tasks=20', '--eval_tasks=20', '--device=cpu', '--max_turns=12'])
    g = load_gym(cfg)
    tasks = g['train_tasks'][:20]
    oracle = gm.folded_policy(gm.oracle_policy)
    m = report.episode_metrics([report.summarise(t) for t in run_tasks([oracle] * len(tasks), g, cfg, tasks)])
    assert m['turn_format_ok'] == 1.0 and m['format_ok'] == 1.0
    junk_first = lambda ep: 'ada </mem>' if not ep.actions else oracle(ep)  # no <search> / <answer>: malformed
    trajs = run_tasks([junk_first] * len(tasks), g, cfg, tasks)
    turns = sum(t.info['n_turns'] for t in trajs)
    m = report.episode_metrics([report.summarise(t) for t in trajs])
    assert m['turn_format_ok'] == pytest.approx(1 - len(tasks) / turns) and m['format_ok'] == 0.0


def test_warm_start_says_when_scripted_turns_are_cut(tmp_path, capsys):
    """A max_response_tokens below the scripted policy's turns would teach turns that never end: one warning."""
    args = ['config/tiny_mem.yaml', '--steps=0', '--warmstart_steps=1', '--warmstart_episodes=4', '--eval_tasks=2',
            '--train_tasks=20', '--threads=1', '--n_embd=32']
    env = dict(os.environ, HF_HUB_OFFLINE='1')
    p = run_script('train.py', [*args, f'--out_dir={tmp_path / "a"}'], cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0 and 'warning' not in p.stderr, p.stderr[-2000:]
    p = run_script('train.py', [*args, '--max_response_tokens=6', f'--out_dir={tmp_path / "b"}'], cwd=ROOT, env=env,
                   timeout=300)
    warned = [line for line in p.stderr.splitlines() if line.startswith('warning: warm start:')]
    assert p.returncode == 0 and len(warned) == 1 and 'scripted turns are cut at max_response_tokens=6' in warned[0]
    import train as T  # PPO-ptx's own scripted episodes say whose they are
    cfg = T.load_config([*args, '--max_response_tokens=6', '--sft_coef=1'])
    T.scripted_episodes(load_gym(cfg), cfg, random.Random(0), 'PPO-ptx (sft_coef)')
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1 and warned[0].startswith('warning: PPO-ptx (sft_coef): ') and 'whole turns are imitated' in warned[0]


def test_resume_names_the_settings_that_differ_from_the_checkpoint(tmp_path, capsys):
    import train as T
    args = ['config/example.yaml', '--warmstart_episodes=8', '--warmstart_steps=2', '--eval_tasks=2', '--eval_samples=1',
            '--batch_size=2', '--group_size=2', f'--out_dir={tmp_path}']
    T.main(args + ['--steps=1', '--overwrite=True'])  # how a run started is not one of its settings
    capsys.readouterr()
    T.main(args + ['--steps=2', '--resume=True', '--lr=5e-4', '--eval_every=1'])
    err = capsys.readouterr().err
    assert 'the run goes on with settings other than its checkpoint' in err and 'lr 0.0003 there, 0.0005 here' in err
    assert 'eval_every' not in err and 'steps' not in err  # run keys change freely
    T.main([f'--out_dir={tmp_path}', '--steps=3', '--resume'])  # no config file: the run's own settings go on
    assert 'settings other than' not in capsys.readouterr().err
    with open(tmp_path / 'metrics.jsonl') as f:
        assert [json.loads(line)['step'] for line in f] == [0, 1, 2, 3]
    with open(tmp_path / 'config.json') as f:
        saved = json.load(f)
    assert (saved['gym'], saved['group_size'], saved['lr'], saved['resume']) == ('example', 2, 5e-4, True)
    T.main([f'--out_dir={tmp_path}', '--steps=4', '--resume', '--min_lr=0'])  # a cosine schedule ends at steps
    err = capsys.readouterr().err
    assert 'steps 3 there, 4 here' in err and 'min_lr -1.0 there, 0.0 here' in err


def rss_gb():
    with open('/proc/self/status') as f:
        return int(f.read().split('VmRSS:')[1].split()[0]) * 1024 / 1e9


@pytest.mark.skipif(not os.path.exists('/proc/self/clear_refs'), reason='VmHWM and its reset are Linux')
def test_peak_memory_is_each_steps_own():
    peak_memory_gb('cpu')  # reset
    x = torch.ones(100_000_000)  # 0.4 GB, touched
    del x
    assert peak_memory_gb('cpu') >= rss_gb() + 0.35  # the peak saw the freed tensor
    assert peak_memory_gb('cpu') <= rss_gb() + 0.05  # and the previous call reset it


@pytest.mark.skipif(sys.platform != 'linux' or not os.path.exists('/proc/self/status'), reason='glibc and /proc')
def test_release_memory_hands_a_fragmented_heaps_free_pages_back_only_when_the_machine_runs_short():
    blocks = [torch.ones(25_000) for _ in range(4000)]  # 100 kB each, below glibc's mmap threshold: on the heap
    kept = blocks[::10]  # every tenth stays, so free() cannot shrink the heap from its top
    del blocks
    before = rss_gb()
    release_memory(headroom=0.0)  # available memory is never below 0% of the total: kept for reuse
    assert abs(rss_gb() - before) < 0.05
    release_memory(headroom=1.0)  # always below 100%: handed back
    assert before - rss_gb() >= 0.2, (before, rss_gb())  # ~0.36 GB of freed blocks were still resident
    assert len(kept) == 400


def test_same_numbers_skips_the_machines_keys_and_names_any_other_difference(tmp_path):
    """scripts/same_numbers.py, the check of a restructure: times and memory may differ, nothing else."""
    line = dict(step=1, reward_mean=0.25, step_time_s=3.0, tokens_per_s=100.0, mem_reward_time_s=0.5, peak_memory_gb=1.0)
    runs = {'a': [line], 'b': [dict(line, step_time_s=9.0, tokens_per_s=7.0, mem_reward_time_s=0.1, peak_memory_gb=2.0)],
            'c': [dict(line, reward_mean=0.25000001)]}
    for name, rows in runs.items():
        (tmp_path / f'{name}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    same = [sys.executable, 'scripts/same_numbers.py', str(tmp_path / 'a.jsonl')]
    ok = subprocess.run(same + [str(tmp_path / 'b.jsonl')], cwd=ROOT, capture_output=True, text=True)
    bad = subprocess.run(same + [str(tmp_path / 'c.jsonl')], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith('same numbers')
    assert bad.returncode == 1 and bad.stdout.strip() == 'step 1: reward_mean 0.25 against 0.25000001'


def test_rl_draws_only_the_questions_with_enough_parts_while_the_warm_start_imitates_all(monkeypatch, tmp_path, capsys):
    """--rl_min_objectives=2: every task handed to an RL rollout (group_size copies) has 2+ parts, the
    warm start's tasks still include single-part ones, and the setup line says how many RL draws from."""
    import train
    seen = {'warm': set(), 'rl': set()}
    run_tasks = train.run_tasks

    def spy(policy, gym_, cfg, tasks, group_size=1, *a, **kw):
        if isinstance(policy, list):  # scripted policies: the warm start
            seen['warm'] |= {len(t.golds) for t in tasks}
        elif group_size == cfg['group_size'] and a:  # RL: group ids passed
            seen['rl'] |= {len(t.golds) for t in tasks}
        return run_tasks(policy, gym_, cfg, tasks, group_size, *a, **kw)
    monkeypatch.setattr(train, 'run_tasks', spy)
    train.main(['config/tiny_mem.yaml', '--max_objectives=2', '--rl_min_objectives=2', '--train_tasks=40', '--eval_tasks=4',
                '--warmstart_episodes=12', '--warmstart_steps=1', '--steps=3', '--batch_size=2', '--group_size=2',
                '--eval_every=0', '--n_embd=32', '--device=cpu', f'--out_dir={tmp_path}'])
    assert seen['rl'] == {2} and 1 in seen['warm']
    n_rl = sum(len(t.golds) >= 2 for t in gm.make_tasks('train', 40, seed=config['seed'], n_objectives=(1, 2)))
    assert f'40 train ({n_rl} for RL) / 4 held-out' in capsys.readouterr().out
