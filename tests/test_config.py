import glob
import os
import re
import subprocess
import sys

import pytest

from gym import gym_module, gym_modules
from script_server import run_script
from train import config, load_config

ROOT = __file__.rsplit('/tests/', 1)[0]


def run_train(*args):
    # python train.py in a process of its own, forked from a pre-warmed interpreter (tests/script_server.py):
    # ~0.5 s instead of ~2.5 s of imports for each of these ~60 one-line refusals
    return run_script('train.py', args, cwd=ROOT, timeout=60, env=dict(os.environ, HF_HUB_OFFLINE='1'))


@pytest.mark.parametrize('args, needle', [
    (['--stpes=3'], "unknown config key 'stpes' (did you mean 'steps'?)"),
    (['--learning_rate=1e-4'], "unknown config key 'learning_rate' (did you mean 'lr'?)"),  # TRL's name
    (['--num_generations=8'], "unknown config key 'num_generations' (did you mean 'group_size'?)"),
    (['--steps=abc'], "config key 'steps' expects int, got 'abc'"),
    (['--resume=maybe'], '--resume=maybe: expected true or false (or 1/yes, 0/no)'),
    (['--tis_cap=0.5'], "config key 'tis_cap' must be 0 (off) or >= 1 (e.g. 2), got 0.5: below 1 it caps nearly every token (weights are about 1)"),
    (['config/does_not_exist.yaml'], 'config file not found: config/does_not_exist.yaml'),
    (['--kl_type=k4'], "config key 'kl_type' must be one of k1, k2, k3, got 'k4'"),
    (['--keep_tool_results=some'], "config key 'keep_tool_results' expects 'all' or an integer >= 1"),
    (['--keep_tool_results=0'], "config key 'keep_tool_results' expects 'all' or an integer >= 1"),
    (['--device=tpu'], "config key 'device': unknown device 'tpu'"),
    (['--lr_rate=1'], "unknown config key 'lr_rate' (did you mean 'lr'?)"),
    (['config'], 'config file is a directory: config (a run folder is given as --out_dir=config)'),
    (['--train_generated=-1'], "config key 'train_generated' must be >= 0, got -1"),
    (['--n_head=3'], "config key 'n_head' (3) must divide n_embd (128)"),
    (['--mem_coef=1'], "config key 'mem_coef' (1.0) needs a gym whose turns write <mem> (memory, searchqa), not 'bugfix'"),
    (['--threads=100000'], "config key 'threads' (100000) is more than this machine's"),
    (['--lr=abc'], "config key 'lr' expects float, got 'abc'"),
    (['--out_dir='], "config key 'out_dir' is empty: name the run's folder"),
    (['--model=/no/such/model', '--gym=memory'], "model '/no/such/model': no such folder"),
    (['--min_lr=0.1'], "config key 'min_lr' (0.1) must not exceed lr (0.001)"),
    (['--lr=nan'], "config key 'lr' must be a finite number, got nan"),
    (['--beta1=2'], "config key 'beta1' must be in [0, 1), got 2.0"),
    (['--gguf_file=x.gguf'], "config key 'gguf_file' names a file in a Hugging Face model folder or repo; model 'tiny' has none"),
    (['--seed=99999999999999999999'], "config key 'seed' must be in [0, 4294967296), got 99999999999999999999"),
    (['--weight_decay=-1'], "config key 'weight_decay' must be >= 0, got -1.0"),
    (['--truncation_penalty=-0.5'], "config key 'truncation_penalty' must be >= 0, got -0.5"),
    (['--train_variants=3', '--gym=memory'], "config key 'train_variants' is not used by gym 'memory'"),
    (['--gym=sandbox'], "unknown gym 'sandbox'; the gyms: " + ', '.join(gym_modules())),  # a forked gym joins the list
    (['--gym=memry'], "unknown gym 'memry' (did you mean 'memory'?); the gyms: "),
    (['--gym=searchqa'], "gym 'searchqa' needs a Hugging Face chat model"),
    (['--model=smollm2'], "gym 'bugfix' builds its own word vocabulary for model: tiny, not 'smollm2'"),
    (['--gym=searchqa', '--model=no-such-org/no-such-model'],
     "cannot load the tokenizer of model 'no-such-org/no-such-model'"),
    (['--lora_rank=4'], "config key 'lora_rank' needs a Hugging Face model"),
    (['--chat_template=qwen3'], "config key 'chat_template' needs a Hugging Face model"),
    (['config/tiny_qwen3_quixbugs.yaml', '--lora_rank=1000'], "config key 'lora_rank' (1000) is above the model's hidden size"),
    (['config/smoke.yaml', '--steps', '3'], "config file not found: 3 (flags take their value after '=': --steps=3)"),
    (['--steps'], "--steps needs a value, e.g. --steps=100"),
    (['--steps='], "--steps needs a value, e.g. --steps=100"),
    (['--resume', 'false'], "config file not found: false (flags take their value after '=': --resume=false)"),
    (['config/smoke.yaml', '--resume', '--steps', '1'], "config file not found: 1 (flags take their value after '=': --steps=1)"),
    (['--resume', '--overwrite'], '--resume=True continues the run in out_dir and --overwrite=True replaces it'),  # bare flags set True
    (['config/smoke.yaml', 'steps=3'], "config file not found: steps=3 (a config key is written --steps=3)"),
    (['--log_every=0'], "config key 'log_every' must be >= 1, got 0"),
    (['--batch_size=2', '--group_size=2', '--mini_batches=5'],
     "config key 'mini_batches' (5) is more than the 4 episodes of a step (batch_size x group_size)"),
    (['--clip_low=2'], "config key 'clip_low' must be below 1, got 2.0"),
    (['--resume=True', '--overwrite=True'], '--resume=True continues the run in out_dir and --overwrite=True replaces it'),
    (['config/tiny_mem.yaml', '--max_objectives=0'], "config key 'max_objectives' must be >= 1, got 0"),
    (['--eval_tasks=49'], "config key 'eval_tasks' asks for 49 held-out tasks; gym 'bugfix' has 48 (0 = all of them)"),
    (['--model=tiny-qwen3', '--n_layer=4'], "config key 'n_layer' sizes the tiny model; model 'tiny-qwen3' has its own (drop it)"),
    (['--gym=memory', '--oracle_forget=1.5'], "config key 'oracle_forget' is a probability, in [0, 1], got 1.5"),
    (['--gym=memory', '--oracle_detour=-0.1'], "config key 'oracle_detour' is a probability, in [0, 1], got -0.1"),
    (['--gym=memory', '--oracle_stuck=1.5'], "config key 'oracle_stuck' is a probability, in [0, 1], got 1.5"),
    (['--gym=memory', '--val_tasks=-3'], "config key 'val_tasks' must be >= 0, got -3"),
    (['--out_dir=README.md'], "config key 'out_dir' names a file, not a folder: README.md"),
    (['--gym=searchqa', '--model=tiny-qwen3', '--prompt_style=foo'],
     "config key 'prompt_style' must be 'train' or 'eval', got 'foo'"),
    (['--gym=quixbugs', '--model=tiny-qwen3', '--chat_template=no/such.jinja'],
     "config key 'chat_template': cannot read 'no/such.jinja'"),
])
def test_config_errors_exit_2_with_one_line(args, needle):
    p = run_train(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_refusals_print_and_make_nothing_first(tmp_path):
    for args in (['--gym=bugfx'], ['--gym=memory', '--train_variants=3'], ['--gym=memory', '--max_objectives=0']):
        p = run_train(*args, f'--out_dir={tmp_path / "run"}')
        assert p.returncode == 2 and p.stdout == '' and not (tmp_path / 'run').exists(), p.stdout[:200]
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'metrics.jsonl').write_text('{"step": 0}\n')  # an earlier run: refused before the set-up
    p = run_train(f'--out_dir={tmp_path / "run"}')
    assert p.returncode == 2 and p.stdout == '' and 'holds an earlier run' in p.stderr


def test_combination_error_names_a_file_only_when_every_key_set_came_from_it(tmp_path, capsys):
    f, g = tmp_path / 'head.yaml', tmp_path / 'both.yaml'
    f.write_text('n_head: 3\n')
    g.write_text('n_head: 4\nn_embd: 130\n')
    for argv, error in (([str(f)], f"config file {f}: config key 'n_head' (3) must divide n_embd (128)"),  # n_embd default
                        ([str(g)], f"config file {g}: config key 'n_head' (4) must divide n_embd (130)"),
                        ([str(g), '--n_head=3'], "config key 'n_head' (3) must divide n_embd (130)"),  # from 2 places
                        ([str(f), '--n_embd=130'], "config key 'n_head' (3) must divide n_embd (130)")):
        with pytest.raises(SystemExit):
            load_config(argv)
        assert capsys.readouterr().err == f'error: {error}\n', argv


def test_bad_yaml_file_exit_2(tmp_path):
    bad = tmp_path / 'bad.yaml'
    bad.write_text('steps: [1, 2\n')
    p = run_train(str(bad))
    assert p.returncode == 2 and f'cannot parse YAML file {bad}' in p.stderr and len(p.stderr.strip().splitlines()) == 1
    latin = tmp_path / 'latin.yaml'
    latin.write_bytes('out_dir: caf\u00e9\n'.encode('latin-1'))
    p = run_train(str(latin))
    assert p.returncode == 2 and f'cannot read YAML file {latin}: not UTF-8 text' in p.stderr
    wrong = tmp_path / 'wrong.yaml'
    wrong.write_text('lr: fast\n')
    p = run_train(str(wrong))
    assert p.returncode == 2 and f"error: config file {wrong}: config key 'lr' expects float, got 'fast'" in p.stderr
    wrong.write_text('# steps: 3\n')  # nothing set: not a default run started without a word
    p = run_train(str(wrong))
    assert p.returncode == 2 and p.stderr == f'error: config file {wrong} sets no config keys\n'
    wrong.write_text('stpes: 3\n')
    p = run_train(str(wrong))
    assert p.returncode == 2 and f"error: config file {wrong}: unknown config key 'stpes' (did you mean 'steps'?)" in p.stderr
    wrong.write_text('gym: memory\noracle_forget: 1.5\n')  # a range checked after merging still names its file
    p = run_train(str(wrong))
    assert p.returncode == 2 and p.stderr == f"error: config file {wrong}: config key 'oracle_forget' is a probability, in [0, 1], got 1.5\n"
    p = run_train(str(wrong), '--oracle_forget=2')  # the flag's value is the bad one: no file to name
    assert p.returncode == 2 and p.stderr == "error: config key 'oracle_forget' is a probability, in [0, 1], got 2.0\n"


def test_config_order_defaults_file_cli(tmp_path):
    f = tmp_path / 'c.yaml'
    f.write_text('steps: 7\nlr: 1\nkeep_tool_results: 1\n')
    cfg = load_config([str(f), '--steps=9'])
    assert cfg['steps'] == 9 and cfg['lr'] == 1.0 and isinstance(cfg['lr'], float)
    assert cfg['keep_tool_results'] == 1 and cfg['batch_size'] == config['batch_size']
    assert load_config(['--keep_tool_results=all'])['keep_tool_results'] == 'all'
    # a flag before the file still overrides it; files keep their order among themselves
    g = tmp_path / 'd.yaml'
    g.write_text('steps: 8\n')
    assert load_config(['--steps=9', str(f)])['steps'] == 9 and load_config([str(g), str(f)])['steps'] == 7
    assert load_config(['--steps=9', str(f), '--steps=10'])['steps'] == 10
    assert load_config(['--resume'])['resume'] is True and load_config(['--resume', '--resume=false'])['resume'] is False


def test_saved_config_is_the_base_and_argv_goes_on_top(tmp_path):
    from config import load_saved_config
    saved = dict(config, gym='memory', max_objectives=3, seed=5, steps=40, resume=False, overwrite=True)
    cfg = load_saved_config(['--resume'], saved)  # a bare resume: the run's own settings
    assert (cfg['gym'], cfg['max_objectives'], cfg['seed'], cfg['resume'], cfg['overwrite']) == ('memory', 3, 5, True, False)
    assert load_saved_config(['--steps=60'], saved)['steps'] == 60 and load_saved_config(['--gym=memory'], saved)['seed'] == 5
    f = tmp_path / 'b.yaml'
    f.write_text('gym: bugfix\n')
    for argv in (['--gym=bugfix'], [str(f)]):  # another gym: argv alone (the saved memory key would fail first)
        cfg = load_saved_config(argv, saved)
        assert cfg['gym'] == 'bugfix' and cfg['max_objectives'] == config['max_objectives'] and cfg['seed'] == config['seed']
    cfg = load_saved_config(['--model=tiny-qwen3'], dict(saved, max_objectives=config['max_objectives']))
    assert (cfg['gym'], cfg['model']) == ('memory', 'tiny-qwen3')  # another model: the saved gym stays, so the caller names the model


def test_bare_bool_flag_is_not_taken_for_a_flag_missing_its_value(capsys):
    with pytest.raises(SystemExit):
        load_config(['--resume', 'no/such/run'])  # not "--resume=no/such/run": a bare --resume is whole
    assert capsys.readouterr().err == 'error: config file not found: no/such/run\n'


@pytest.mark.parametrize('content, needle', [
    (None, "no such file, and not a named set (hotpotqa, bamboogle)"),
    ('{"id": "a", "question": "q?", "answers": ["x"]}\n{"id": "b", "question": \n', 'bad.jsonl:2'),
    ('{"id": "a", "question": "q?", "answers": []}\n', 'bad.jsonl:1'),
    ('', 'bad.jsonl'),
])
def test_bad_data_stops_before_training_with_one_line(tmp_path, content, needle):
    path = tmp_path / 'bad.jsonl'
    if content is not None:
        path.write_text(content)
    p = run_train('--gym=searchqa', '--model=tiny-qwen3', f'--data={path}', f'--out_dir={tmp_path / "out"}')
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith('error: '), p.stderr
    assert not (tmp_path / 'out').exists()  # not even an empty out_dir


def test_yaml_error_names_line_and_column(tmp_path):
    bad = tmp_path / 'bad.yaml'
    bad.write_text('steps: 3\nlr: [1, 2\nseed: 4\n')
    p = run_train(str(bad))
    assert p.returncode == 2 and p.stderr.count('\n') == 1
    assert p.stderr.startswith(f'error: cannot parse YAML file {bad}:3:')


def test_a_key_twice_in_a_yaml_file_is_refused(tmp_path, capsys):
    """YAML keeps the last of two equal keys without a word: a user editing one `lr:` line while the
    other wins would train with a learning rate they never see."""
    twice = tmp_path / 'twice.yaml'
    twice.write_text('lr: 0.1\nsteps: 3\nlr: 0.2\n')
    with pytest.raises(SystemExit) as e:
        load_config([str(twice)])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: config file {twice}: key 'lr' appears twice (again on line 3)\n"
    (tmp_path / 'once.yaml').write_text('lr: 0.1\nsteps: 3\n')
    assert load_config([str(tmp_path / 'once.yaml')])['lr'] == 0.1


def test_help_prints_usage_and_keys():
    p = run_train('--help')
    assert p.returncode == 0 and 'python train.py config/tiny.yaml' in p.stdout and re.search(r"(^| )kl_coef=0.0( |$)", p.stdout, re.M)


def test_max_len_too_short_for_the_prompts_exits_2_with_one_line(tmp_path):
    # no HotpotQA prompt (25-70 tokens with the forced '<mem>\n') leaves room for a
    # 16-token turn in 32; this used to be a traceback from collate at the first step
    p = run_train('--gym=searchqa', '--model=tiny-qwen3', '--max_len=32', '--max_response_tokens=16',
                  f'--out_dir={tmp_path / "out"}')
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert lines == ['error: max_len=32 is too short: the longest prompt is 70 tokens and a turn needs '
                     'max_response_tokens=16 more'], p.stderr
    assert not (tmp_path / 'out' / 'metrics.jsonl').exists()


def test_a_typo_of_a_scripts_own_option_names_that_option(capsys):
    """sample.py --sample=4 used to be reported as a config key (did you mean 'eval_samples'?)."""
    from config import parse_options
    defaults = dict(samples=1, html='', greedy=False)
    for argv, err in [(['--sample=4'], "unknown option '--sample' (did you mean '--samples'?)"),
                      (['--greed'], "unknown option '--greed' (did you mean '--greedy'?)"),
                      (['--html'], '--html needs a value, e.g. --html=FILE'),
                      (['--samples=abc'], "--samples expects int, got 'abc'")]:
        with pytest.raises(SystemExit) as e:
            parse_options(argv, defaults)
        assert e.value.code == 2 and capsys.readouterr().err == f'error: {err}\n'
    opts, rest = parse_options(['--samples=4', '--eval_task=3', 'c.yaml'], defaults)  # nearer a config key: train.py's
    assert opts['samples'] == 4 and rest == ['--eval_task=3', 'c.yaml']


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(ROOT, 'config', '*.yaml'))), ids=os.path.basename)
def test_every_shipped_config_loads(path):
    """Each config/*.yaml passes the checks a run makes before it starts (keys, values, combinations, the
    gym's keys): a recipe edited by hand cannot ship a typo that only a training run would find."""
    cfg = load_config([path])
    gym_module(cfg, config)
    assert cfg['gym'] in gym_modules()


def test_every_config_key_is_explained_in_config_py():
    """--help says each key is explained in config.py: every key's line in the defaults has a comment."""
    src = open(os.path.join(os.path.dirname(__file__), '..', 'config.py')).read()
    lines = src[src.index('config = dict('):src.index('\nTYPES')].splitlines()[1:]
    silent = [line.split('=')[0].strip() for line in lines if '=' in line and '#' not in line]
    assert not silent, f'config keys without a comment in config.py: {silent}'
    assert all(any(line.lstrip().startswith(k + '=') or f' {k}=' in line for line in lines) for k in config)


def test_every_peer_name_points_at_a_key_of_ours():
    from config import PEER_KEYS
    assert set(PEER_KEYS.values()) <= set(config) and not set(PEER_KEYS) & set(config)


@pytest.mark.parametrize('args, noted', [(['--warmstart_steps=0'], True), (['--warmstart_episodes=0'], True),
                                         (['--warmstart_steps=0', '--sft_coef=1'], False), ([], False),
                                         (['--warmstart_steps=0', '--oracle_stuck=0'], False)])
def test_a_scripted_mistake_that_nothing_trains_on_is_noted(capsys, args, noted):
    """oracle_stuck (and oracle_forget, oracle_detour) shape only the scripted episodes: without a warm
    start and without PPO-ptx they change nothing, and the run says so."""
    import config as config_lib
    cfg = load_config(['config/tiny_mem.yaml', '--show_budget=true', '--oracle_stuck=0.25', '--device=cpu',
                       '--dtype=float32', *args])
    config_lib.check_run(cfg)
    err = capsys.readouterr().err
    assert ('note: oracle_stuck shapes the scripted episodes, which neither a warm start' in err) == noted, err
