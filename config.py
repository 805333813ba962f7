"""
The config: every default in one place; YAML files override it; --key=value overrides the files.
Also the process a run is: torchrun's rank and world size, and the collectives data parallelism needs.

    from config import load_config
    cfg = load_config(['config/tiny.yaml', '--steps=50'])

Every value is type-checked against its default; an unknown key, a wrong type or a value out of range
stops the program with one line naming the key (exit status 2). Gym-specific keys (marked `gym:`) are
checked by gym.load_gym against the keys the chosen gym reads.
"""

import difflib
import math
import os
import sys
import textwrap

import torch
import yaml

from gym import fail, gym_module  # fail: one line `error: ...`, exit status 2; the scripts import it from here

config = dict(
    # run
    gym='bugfix',                # a file in gyms/: bugfix | memory | searchqa | quixbugs | example
    seed=1337,                   # seeds Python's, torch's and the gym's generators; same seed, same run
    device='cpu',                # cpu | cuda | cuda:N
    dtype='float32',             # float32 | bfloat16 (autocast, CUDA and CPU) | auto: bf16 where the device has it natively
    threads=0,                   # torch CPU threads; 0 = torch's default
    out_dir='out',               # checkpoints, metrics.jsonl, config.json, curves.png
    resume=False,                # continue from the newest checkpoint in out_dir
    overwrite=False,             # a fresh run in an out_dir holding another run's checkpoints: replace them
    compile=False,               # torch.compile the policy (CUDA)
    # model
    model='tiny',                # tiny | a Hugging Face name or path
    gguf_file='',                # a .gguf file inside model's folder or Hub repo (transformers dequantises it)
    chat_template='',            # '' = the model's own; 'qwen3' = ours (templates/qwen3.jinja, with tools); or a .jinja path
    n_layer=2, n_head=4, n_embd=128,  # model tiny and tiny-qwen3: the shape of the from-scratch transformer
    max_len=256,                 # tokens a context may hold; an episode that would pass it stops (stop 'max_len')
    grad_checkpointing=False,    # recompute activations in the backward (Hugging Face models): less memory, slower
    lora_rank=0,                 # > 0: train LoRA adapters of this rank only (optional package peft); 0: every weight
    lora_alpha=32.0,             # LoRA scale alpha / rank
    enable_thinking=False,       # chat templates with a thinking switch (Qwen3)
    require_think=False,         # gym searchqa: every turn needs <think> (always when enable_thinking)
    # rollout
    max_turns=12,                # policy turns per episode; the rollout stops it after the last (stop 'max_turns';
                                 # 'budget' where the gym's own budget is max_turns: example, bugfix, quixbugs, searchqa)
    max_response_tokens=6,       # tokens the policy may write in one turn, its stop token included
    temperature=1.0,             # sampling temperature of rollouts (evaluation's greedy runs ignore it)
    keep_tool_results='all',     # 'all' = full history; an int k = MemPO folding (prompt + last <mem> + last k results)
    kv_reuse=False,              # keep the KV cache of the prefix a turn shares with the last one (rollout.py)
    pack_turns=False,            # folded turns train as one row per episode, their shared prompt once (rollout.pack_rows)
    # gym data and sizes
    data='',                     # gym searchqa: hotpotqa | bamboogle | a JSONL path of {id, question, answers}
    prompt_style='train',        # gym searchqa: 'train' (bare question) | 'eval' (format instructions)
    max_obs_tokens=400,          # gym searchqa: tokens of search results per observation
    answer_reward='em',          # gym searchqa, memory: 'em' (objectives answered exactly, MemPO's) | 'f1' (their
                                 # token F1 summed) | 'all' (k points only when all k are right; gyms/answers.py)
    complete_bonus=0.0,          # gym memory: points added to a well-formed answer when every part of it is right
    hop_reward=0.0,              # gym memory: points added to a well-formed answer for the question's hops found in
                                 # order, as a fraction of them all (a process reward; gyms/memory.py MemoryEnv)
    train_tasks=0,               # gym memory, searchqa: training tasks, 0 = the gym's default
    max_objectives=4,            # gym memory: training questions have 1..max_objectives parts, held-out one more
    oracle_forget=0.0,           # gym memory: chance the warm-start oracle forgets an answer in <mem> (the lossy set-up)
    oracle_detour=0.0,           # gym memory: chance a warm-start episode makes one wrong search, then recovers
    oracle_stuck=0.0,            # gym memory: chance a warm-start episode repeats a wrong search to its last turn, then
                                 # answers what its notes hold (needs show_budget)
    show_budget=False,           # gym memory: each observation ends with 'turns left N' (under folding the policy
                                 # cannot count its turns otherwise)
    val_tasks=0,                 # gym memory, bugfix: validation tasks (their own worlds / functions), evaluated after
                                 # held-out (eval_val_*); 0 = none; bugfix: at most eval_tasks of them
    train_variants=24,           # gym bugfix: variants per training function (names, constants, which op broke it)
    train_generated=0,           # gym bugfix: random training functions from a grammar, added to the 22 templates
    eval_tasks=0,                # 0 = all of the gym's held-out tasks (memory: 96)
    eval_samples=4,              # sampled episodes per held-out task at each evaluation
    # warm start (SFT on scripted episodes)
    warmstart_episodes=512,      # scripted episodes the warm start imitates (0 steps: no warm start)
    warmstart_steps=200,         # optimizer steps of the warm start
    warmstart_lr=3e-3,           # peak lr of the warm start (warm-up, then cosine decay to a tenth)
    warmstart_batch_size=32,     # episodes per step, with all their rows (folding: one row per turn)
    warmstart_full=False,        # folding: each scripted episode also trains as one row with its full history
                                 # (the context MemPO's P_full reads; advantage.memory_rewards)
    # RL
    steps=100,                   # RL steps; 0: the warm start and the step-0 evaluation only
    batch_size=8,                # tasks per step
    group_size=8,                # rollouts per task
    rl_min_objectives=1,         # gym memory: RL draws only training questions with at least this many parts (the
                                 # warm start imitates them all)
    rl_spare_turns=1,            # gym memory: turns an RL episode may spend beyond the oracle's (a search per hop and
                                 # the answer) before the gym's budget ends it; evaluations and scripted episodes keep 1
    lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.99,  # AdamW of the RL steps
    warmup_steps=5,              # RL steps of linear lr warm-up from 0
    min_lr=-1.0,                 # >= 0: cosine decay from lr to min_lr over the RL steps after warm-up; < 0: constant lr
    grad_clip=1.0,               # clip the gradient's global norm to this (0: no clipping)
    ppo_epochs=1,                # passes over a step's rollouts
    mini_batches=2,              # mini-batches per epoch (each an optimizer step)
    clip_low=0.2, clip_high=0.28,  # PPO's ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO's clip-higher)
    kl_coef=0.0,                 # weight of the KL penalty to the frozen reference (the policy after the warm start)
    sft_coef=0.0,                # PPO-ptx: weight of the warm start's imitation loss on scripted episodes, added to each
                                 # RL step's first mini-batch (train.py ppo_update); 0 = off
    sft_batch_size=3,            # PPO-ptx: scripted episodes (with all their rows) imitated per RL step
    kl_type='k3',                # k1 | k2 | k3
    loss_agg='token-mean',       # token-mean | seq-mean | drgrpo
    adv_std=True,                # divide by the group std (False: Dr.GRPO's r - mean)
    adv_eps=1e-6,                # added to a group's std before dividing
    mem_coef=0.0,                # weight of MemPO's memory advantage on <mem> tokens
    mem_pool='group',            # the memory reward normalised over: 'group' (MemPO) | 'turn' (group x turn index)
    mem_std=True,                # divide the memory reward by its pool's std (False: centred only)
    mem_success_only=False,      # score memories of successful episodes only (InfoMem)
    mem_target='answer',         # gym memory: P scores the whole gold 'answer' | the answers 'found' by that turn
    mem_baseline='full',         # the memory reward is P_mem - P_full ('full', MemPO's) | P_mem alone ('none': the
                                 # pool's mean is the baseline; no full-history pass)
    truncation_penalty=0.0,      # subtracted from the reward of an episode cut by a limit (out of turns or context)
                                 # for its advantage only (DAPO's overlong punishment); logged rewards stay the gym's
    tis_cap=0.0,                 # >= 1: old log-probs recomputed by the trainer, and each token's policy-gradient term
                                 # weighted by min(pi_old / pi_sampler, tis_cap) (truncated importance sampling)
    oversample=1.0,              # > 1: roll out batch_size x oversample groups, keep batch_size, those with signal first
    skip_zero_advantage=False,   # the update skips the forward and backward of rows whose advantages are all 0 (their
                                 # gradient is 0 without a KL term): same step up to rounding, metrics over rows trained
    max_tokens_per_microbatch=16384,  # padded tokens a forward + backward holds at once; activations grow with it
    max_bad_steps=3,             # stop (exit 1) after this many steps in a row with a non-finite loss
    # logging
    eval_every=25,               # evaluate every N RL steps; 0: at step 0 and the last step only
    log_every=10,                # a plain progress line every log_every steps when stderr is not a terminal
    save_every=25,               # checkpoint every N RL steps; 0: at step 0 and the last step only
    keep_checkpoints=2,          # the newest N checkpoints stay, and step 0's (the warm start, which recipes resume from)
    tensorboard=False,           # mirror metrics.jsonl to TensorBoard (out_dir/tb) if tensorboard is installed
    wandb_project='',            # mirror metrics.jsonl to this Weights & Biases project if wandb is installed
    dump_rollouts=False,         # at each eval step save the training batch (+ advantages) for sample.py
)
TYPES = {'keep_tool_results': (str, int)}  # keys whose values may take more than one type
# keys only training reads: what to do with out_dir, and the warm start, RL and logging sections above
TRAINING_KEYS = ('resume', 'overwrite', *list(config)[list(config).index('warmstart_episodes'):])
SCRIPTED_KEYS = ('oracle_forget', 'oracle_detour', 'oracle_stuck')  # keys that shape only the scripted episodes


TRUE_WORDS, FALSE_WORDS = ('true', '1', 'yes'), ('false', '0', 'no')  # what a bool key's value may be written as


def parse_value(key, raw, default):
    """Parse --key=value by the default's type; bools accept TRUE_WORDS and FALSE_WORDS."""
    if isinstance(default, bool):
        if raw.lower() in TRUE_WORDS:
            return True
        if raw.lower() in FALSE_WORDS:
            return False
        fail(f"--{key}={raw}: expected true or false (or {'/'.join(TRUE_WORDS[1:])}, {'/'.join(FALSE_WORDS[1:])})")
    try:
        return yaml.safe_load(raw) if not isinstance(default, str) else raw
    except yaml.YAMLError:
        fail(f'--{key}={raw}: cannot parse the value')


PEER_KEYS = dict(  # other trainers' names for our keys (TRL's GRPOConfig, verl), for the unknown-key message
    learning_rate='lr', num_generations='group_size', beta='kl_coef', kl_loss_coef='kl_coef', epsilon='clip_low',
    epsilon_high='clip_high', clip_ratio='clip_low', max_steps='steps', num_iterations='ppo_epochs',
    max_completion_length='max_response_tokens', loss_type='loss_agg')


def check_key(key, value, cfg, where='', name=None):
    """value, type-checked against cfg[key] (ints are accepted for floats); exits 2 on an unknown key or
    a wrong type, the line starting with `where` (the config file it came from, or nothing) and naming
    the key as `name` (default "config key 'KEY'"; a script's own option passes '--KEY')."""
    if key not in cfg:
        close = [k for k in [PEER_KEYS.get(key)] if k in cfg] or \
            [k for k in cfg if key.startswith(k + '_') or k.startswith(key + '_')][:1] or \
            difflib.get_close_matches(key, list(cfg), n=1)  # lr_rate -> lr (not lora_rank), stpes -> steps
        fail(f"{where}unknown config key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ''))
    default = cfg[key]
    ok_types = TYPES.get(key, (type(default),))
    if float in ok_types and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-4 (no dot) as a string; a float key takes it as the number it is
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) and bool not in ok_types:
        ok = False
    elif float in ok_types and isinstance(value, int):
        ok = True
    else:
        ok = isinstance(value, ok_types)
    if not ok:
        fail(f"{where}{name or f'config key {key!r}'} expects {' or '.join(t.__name__ for t in ok_types)}, got {value!r}")
    return float(value) if float in ok_types and not isinstance(value, bool) else value


def parse_options(argv, defaults):
    """A script's own options, --key=value typed by their defaults (a bare --flag sets a bool to True),
    split from the rest of argv (YAML files and train.py's --key=value). Returns (options, rest);
    exits 2 with one line on a bad value or a non-bool option without one."""
    opts, rest = dict(defaults), []
    for arg in argv:
        key, eq, raw = arg[2:].partition('=')
        if arg.startswith('--') and key not in opts and key not in config:  # a typo of the script's own option (--sample)?
            close = difflib.get_close_matches(key, list(opts) + list(config), n=1)
            if close and close[0] in opts:
                fail(f"unknown option '--{key}' (did you mean '--{close[0]}'?)")
        if not arg.startswith('--') or key not in opts:
            rest.append(arg)
        elif not eq and isinstance(opts[key], bool):
            opts[key] = True
        elif not eq or raw == '':
            fail(f"--{key} needs a value, e.g. --{key}={opts[key] if opts[key] != '' else 'FILE'}")
        else:
            opts[key] = check_key(key, parse_value(key, raw, opts[key]), opts, name=f'--{key}')
    return opts, rest


def read_config_file(path, argv):
    """The mapping of keys to values in the YAML file at path (argv: the whole command line, for a hint
    about '--steps 3'). A missing file, bad YAML, a key written twice, a file that is not a mapping or
    one that sets no key exits 2 with one line naming the file."""
    if not os.path.isfile(path):
        i = argv.index(path)
        before = argv[i - 1] if i else ''  # '--steps 3' for '--steps=3'
        bare = before if before.startswith('--') and '=' not in before and before != '--help' and (
            not isinstance(config.get(before[2:]), bool) or path.lower() in TRUE_WORDS + FALSE_WORDS) \
            else None  # a bare --resume is whole, unless a true/false follows it
        key = path.partition('=')[0]  # 'steps=3' for '--steps=3'
        fail((f'config file is a directory: {path} (a run folder is given as --out_dir={path})' if os.path.isdir(path)
              else f'config file not found: {path}')
             + (f" (flags take their value after '=': {bare}={path})" if bare else
                f" (a config key is written --{path})" if '=' in path and key in config else ''))
    try:
        with open(path) as f:
            text = f.read()
        node, seen = yaml.compose(text), set()  # safe_load keeps the last of two equal keys without a word
        for k, _ in node.value if isinstance(node, yaml.MappingNode) else []:
            if k.value in seen:
                fail(f"config file {path}: key {k.value!r} appears twice (again on line {k.start_mark.line + 1})")
            seen.add(k.value)
        loaded = yaml.safe_load(text)
    except UnicodeDecodeError:
        fail(f'cannot read YAML file {path}: not UTF-8 text')
    except yaml.YAMLError as e:
        mark = getattr(e, 'problem_mark', None)
        where = f':{mark.line + 1}:{mark.column + 1}' if mark else ''
        fail(f'cannot parse YAML file {path}{where}: {getattr(e, "problem", None) or str(e).splitlines()[0]}')
    if loaded is None or loaded == {}:  # empty, comments only or {}: a default run started without a word
        fail(f'config file {path} sets no config keys')
    if not isinstance(loaded, dict):
        fail(f'config file {path} must hold a mapping of keys to values')
    return loaded


def load_config(argv, defaults=config):
    """defaults <- YAML files <- --key=value, each kind in its order on the command line; a --key=value
    overrides every file wherever it stands (`--steps=3 config/tiny.yaml` runs 3 steps), and of a key
    given twice on the command line the last counts (ablate.py appends overrides). Every value is
    type-checked against the default; a bare --flag sets a bool key to True. Any error exits with status
    2 and one line naming the key or file."""
    cfg, origin = dict(defaults), {}  # origin: key set -> 'config file PATH: ', or '' from the command line
    for arg in sorted(argv, key=lambda a: a.startswith('--')):  # stable: files first, then flags
        if arg in ('-h', '--help'):
            print((sys.modules['__main__'].__doc__ or '').strip())
            print('\nconfig keys and their defaults (YAML files, then --key=value; each explained in config.py):')
            print(textwrap.fill('  '.join(f'{k}={v!r}' for k, v in defaults.items()), 100))
            sys.exit(0)
        if arg.startswith('--'):
            key, eq, raw = arg[2:].partition('=')
            if key not in cfg:
                check_key(key, None, cfg)
            if not eq and isinstance(cfg[key], bool):
                raw = 'true'  # a bare --resume sets the flag, as in sample.py and ablate.py
            elif not eq or (raw == '' and not isinstance(defaults[key], str)):  # --steps, --steps= (--chat_template= clears)
                fail(f"--{key} needs a value, e.g. --{key}={defaults[key] if defaults[key] != '' else 'VALUE'}")
            cfg[key] = check_key(key, parse_value(key, raw, cfg[key]), cfg)
            origin[key] = ''
        else:
            for key, value in read_config_file(arg, argv).items():
                origin[key] = f'config file {arg}: '
                cfg[key] = check_key(key, value, cfg, origin[key])
    bad = check_values(cfg, defaults)
    if bad:  # name the file only when every key of the message that was set came from it
        files = {origin[k] for k in ((bad[0],) if isinstance(bad[0], str) else bad[0]) if k in origin}
        fail((files.pop() if len(files) == 1 else '') + bad[1])
    ktr = cfg['keep_tool_results']
    cfg['keep_tool_results'] = ktr if ktr == 'all' else int(ktr)
    cfg['out_dir'] = os.path.expanduser(cfg['out_dir'])
    return cfg


START_KEYS = ('resume', 'overwrite')  # how a run was started, not what it is: never taken from a saved config


def load_saved_config(argv, saved):
    """A run's saved config (its config.json or a checkpoint's) with argv (YAML files, --key=value) on
    top, as load_config merges them onto the defaults: what the run did, unless argv says otherwise.
    A run trained with more threads than this machine has cores gets all of them (a note says so);
    resume and overwrite say how a run was started, not what it is, and come from argv alone. When argv
    names a gym or model other than the saved one, it is argv on the defaults and the saved gym and model
    (the caller refuses the mismatch by name, rather than a saved key of the other gym failing first)."""
    saved, cores = {k: v for k, v in saved.items() if k not in START_KEYS}, os.cpu_count() or 1
    if saved.get('threads', 0) > cores:
        print(f"note: the run used threads={saved['threads']}; this machine has {cores} cores, so {cores}")
        saved['threads'] = cores
    given = {a[2:].partition('=')[0] for a in argv if a.startswith('--')}
    given |= {k for a in argv if not a.startswith('-') for k in read_config_file(a, argv)}
    if given & {'gym', 'model'}:  # another gym or model is another run: argv alone, and the caller names the difference
        own = load_config(argv, dict(config, **{k: saved[k] for k in ('gym', 'model') if k in saved and k not in given}))
        if any(own[k] != saved.get(k, own[k]) for k in ('gym', 'model')):
            return own
    return load_config(argv, dict(config, **saved))


# key -> (lowest, highest) (None: no upper bound), or (lowest, highest, what it is): then closed at the top
RANGES = dict(
    **{k: (1, None) for k in ('log_every', 'batch_size', 'group_size', 'mini_batches', 'ppo_epochs', 'max_turns',
                              'max_response_tokens', 'max_len', 'n_layer', 'n_head', 'n_embd', 'eval_samples',
                              'warmstart_batch_size', 'keep_checkpoints', 'max_tokens_per_microbatch', 'max_bad_steps',
                              'train_variants', 'sft_batch_size')},
    **{k: (0, None) for k in ('steps', 'threads', 'eval_every', 'save_every', 'warmstart_steps', 'warmstart_episodes',
                              'train_tasks', 'train_generated', 'eval_tasks', 'val_tasks', 'warmup_steps', 'kl_coef', 'rl_spare_turns',
                              'mem_coef', 'lr', 'warmstart_lr', 'weight_decay', 'clip_low', 'clip_high', 'grad_clip',
                              'adv_eps', 'lora_rank', 'tis_cap', 'truncation_penalty', 'complete_bonus', 'hop_reward',
                              'sft_coef')},
    oversample=(1, None),
    seed=(0, 2 ** 32), beta1=(0, 1), beta2=(0, 1), oracle_forget=(0, 1, 'a probability'), oracle_detour=(0, 1, 'a probability'),
    oracle_stuck=(0, 1, 'a probability'),
)
CHOICES = dict(mem_pool=('group', 'turn'), mem_target=('answer', 'found'), mem_baseline=('full', 'none'), kl_type=('k1', 'k2', 'k3'), loss_agg=('token-mean', 'seq-mean', 'drgrpo'), dtype=('float32', 'bfloat16', 'auto'))


def check_values(cfg, defaults=config):
    """Ranges (RANGES, CHOICES) and combinations of a merged config's values (defaults: what they were
    merged onto, to tell a value set from one inherited). Returns None, or (key, one-line message)
    for the first bad value (a combination names a tuple of keys): load_config names the file they came from."""
    ktr = cfg['keep_tool_results']
    if not (ktr == 'all' or (str(ktr).isdigit() and int(ktr) >= 1)):  # 3, '3'; not 0, -1, 'some'
        return 'keep_tool_results', f"config key 'keep_tool_results' expects 'all' or an integer >= 1, got {ktr!r}"
    for key, value in cfg.items():  # nan and inf pass every comparison below and end in a traceback later
        if isinstance(value, float) and not math.isfinite(value):
            return key, f"config key '{key}' must be a finite number, got {value!r}"
    for key, (low, high, *what) in RANGES.items():
        if cfg[key] < low or (high is not None and (cfg[key] > high if what else cfg[key] >= high)):
            bound = f'must be >= {low}' if high is None else f"is {what[0]}, in [{low}, {high}]" if what else \
                f'must be in [{low}, {high})'
            return key, f"config key '{key}' {bound}, got {cfg[key]!r}"
    for key, allowed in CHOICES.items():
        if cfg[key] not in allowed:
            return key, f"config key '{key}' must be one of {', '.join(allowed)}, got {cfg[key]!r}"
    return check_combinations(cfg, defaults)


def check_combinations(cfg, defaults):
    """Values fine alone but not together (or not on this machine): (a key or a tuple of the keys
    involved, message) or None."""
    tiny, out_dir = cfg['model'] == 'tiny', os.path.expanduser(cfg['out_dir'])
    try:
        dev = torch.device(cfg['device'])
    except RuntimeError:
        return 'device', f"config key 'device': unknown device {cfg['device']!r} (cpu, cuda, cuda:N)"
    shape = next((k for k in ('n_layer', 'n_head', 'n_embd') if not tiny and cfg[k] != defaults[k]), None)
    rules = [  # (wrong, key or the keys it names, message)
        (cfg['mini_batches'] > cfg['batch_size'] * cfg['group_size'],  # some steps would have no episode
         ('mini_batches', 'batch_size', 'group_size'),
         f"config key 'mini_batches' ({cfg['mini_batches']}) is more than the {cfg['batch_size'] * cfg['group_size']} "
         f"episodes of a step (batch_size x group_size)"),
        (cfg['min_lr'] > cfg['lr'], ('min_lr', 'lr'),
         f"config key 'min_lr' ({cfg['min_lr']!r}) must not exceed lr ({cfg['lr']!r}); a negative min_lr keeps lr constant"),
        (cfg['sft_coef'] and not cfg['warmstart_episodes'], ('sft_coef', 'warmstart_episodes'),
         f"config key 'sft_coef' ({cfg['sft_coef']!r}) imitates the warm start's scripted episodes; warmstart_episodes is 0 "
         f"(set it > 0, or sft_coef: 0)"),
        (cfg['lora_alpha'] <= 0, 'lora_alpha', f"config key 'lora_alpha' must be > 0, got {cfg['lora_alpha']!r}"),
        (0 < cfg['tis_cap'] < 1, 'tis_cap',  # min(w, C) with C < 1: a smaller step, not a correction
         f"config key 'tis_cap' must be 0 (off) or >= 1 (e.g. 2), got {cfg['tis_cap']!r}: "
         "below 1 it caps nearly every token (weights are about 1)"),
        (cfg['chat_template'] and tiny, ('chat_template', 'model'),
         "config key 'chat_template' needs a Hugging Face model; the tiny model has no chat template"),
        (cfg['gguf_file'] and cfg['model'] in ('tiny', 'tiny-qwen3', 'smollm2'), ('gguf_file', 'model'),  # ignored there
         f"config key 'gguf_file' names a file in a Hugging Face model folder or repo; model {cfg['model']!r} has none"),
        (shape is not None, (shape, 'model'),
         f"config key '{shape}' sizes the tiny model; model {cfg['model']!r} has its own (drop it)"),
        (cfg['lora_rank'] and tiny, ('lora_rank', 'model'),
         "config key 'lora_rank' needs a Hugging Face model (model: tiny-qwen3, smollm2 or a name/path), not 'tiny'"),
        (tiny and cfg['n_embd'] % cfg['n_head'], ('n_head', 'n_embd'),
         f"config key 'n_head' ({cfg['n_head']}) must divide n_embd ({cfg['n_embd']})"),
        (cfg['threads'] > (os.cpu_count() or 1), 'threads',
         f"config key 'threads' ({cfg['threads']}) is more than this machine's {os.cpu_count()} cores"),
        (cfg['max_len'] < cfg['max_response_tokens'] + 16, ('max_len', 'max_response_tokens'),
         f"config key 'max_len' ({cfg['max_len']}) leaves no room for a prompt and a response of "
         f"max_response_tokens={cfg['max_response_tokens']}"),
        (cfg['temperature'] <= 0, 'temperature',
         f"config key 'temperature' must be > 0 for training (evaluation also runs greedy), got {cfg['temperature']!r}"),
        (dev.type not in ('cpu', 'cuda'), 'device', f"config key 'device': {cfg['device']!r} is not supported (cpu, cuda, cuda:N)"),
        (cfg['clip_low'] >= 1, 'clip_low', f"config key 'clip_low' must be below 1, got {cfg['clip_low']!r}"),  # ratio >= 0
        (cfg['resume'] and cfg['overwrite'], ('resume', 'overwrite'),
         "--resume=True continues the run in out_dir and --overwrite=True replaces it: choose one"),
        (not out_dir.strip(), 'out_dir', "config key 'out_dir' is empty: name the run's folder (e.g. out/run1)"),
        (os.path.exists(out_dir) and not os.path.isdir(out_dir), 'out_dir',
         f"config key 'out_dir' names a file, not a folder: {out_dir}"),
    ]
    return next(((key, msg) for wrong, key, msg in rules if wrong), None)


def check_run(cfg, master=True):
    """What a training run checks beyond the values, before it makes anything: the device exists, the gym
    is known and reads every gym key set (gym.gym_module); each exits 2 with one line. Warns (rank 0)
    of settings that run but teach little or do nothing."""
    if cfg['device'].startswith('cuda') and not torch.cuda.is_available():
        fail(f"config key 'device' is {cfg['device']!r} but torch sees no CUDA device (use --device=cpu)")
    gym_module(cfg, config)
    resolve_dtype(cfg, master)
    if master and cfg['kl_type'] == 'k1' and cfg['kl_coef']:
        print("warning: kl_type=k1 as a loss has zero gradient in expectation: the KL term holds nothing "
              "back (use k2 or k3)", file=sys.stderr)
    if master and cfg['group_size'] == 1:
        print("warning: group_size=1: a group of one is its own baseline, so every outcome advantage is 0 "
              "and RL learns only from the memory advantage and the KL term", file=sys.stderr)
    if master and cfg['pack_turns'] and cfg['keep_tool_results'] == 'all':
        print("note: pack_turns with keep_tool_results=all: each episode is one row already, so there is "
              "nothing to pack", file=sys.stderr)
    scripted = [k for k in SCRIPTED_KEYS if cfg.get(k)]
    if master and scripted and not cfg['resume'] and not cfg['sft_coef'] and not (cfg['warmstart_steps'] and cfg['warmstart_episodes']):
        print(f"note: {scripted[0]} shapes the scripted episodes, which neither a warm start (warmstart_steps "
              f"{cfg['warmstart_steps']}, warmstart_episodes {cfg['warmstart_episodes']}) nor PPO-ptx (sft_coef 0) "
              "trains on: it changes nothing here", file=sys.stderr)
    if master and cfg['tis_cap'] and cfg['dtype'] == 'float32':
        print("note: tis_cap in float32: the sampler's log-probs are already the trainer's (gap <= 1e-5), so "
              "the correction only adds a forward pass (tis_cap: 0 skips it)", file=sys.stderr)


def resolve_dtype(cfg, master=True):
    """dtype: auto becomes native_dtype's choice for cfg['device'] (in place), printed with its reason on
    rank 0, so train.py and sample.py compute in the same precision; float32 and bfloat16 stay (bfloat16
    where the device lacks it natively with a warning)."""
    if cfg['dtype'] == 'auto':
        cfg['dtype'], why = native_dtype(cfg['device'])
        if master:
            print(f"dtype auto: {cfg['dtype']} ({why})")
    elif cfg['dtype'] == 'bfloat16' and master and (native := native_dtype(cfg['device']))[0] == 'float32':
        print(f"warning: dtype bfloat16 with {native[1]}: bf16 is emulated there or not run at all, "
              "slower than float32 where it runs (dtype: auto picks float32 here)", file=sys.stderr)


def native_dtype(device, cpu_flags=None):
    """(dtype, why) for dtype: auto: 'bfloat16' where the device computes bf16 natively (a CUDA GPU with
    bf16, a CPU whose flags show avx512_bf16 or amx_bf16), else 'float32', which elsewhere is faster.
    cpu_flags: the flags' text (default: read from /proc/cpuinfo; none there: float32)."""
    if str(device).startswith('cuda'):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)  # Ampere on
        return ('bfloat16', 'a CUDA GPU with bf16') if ok else ('float32', 'a CUDA GPU without bf16')
    if cpu_flags is None:
        try:
            cpu_flags = open('/proc/cpuinfo').read()
        except OSError:
            cpu_flags = ''
    native = [f for f in ('amx_bf16', 'avx512_bf16') if f in cpu_flags.split()]
    return ('bfloat16', f'this CPU has {native[0]}') if native else ('float32', 'no native bf16 on this CPU')


# -----------------------------------------------------------------------------
# processes (torchrun data parallelism); a single-process run passes through these


def world_size():
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def all_reduce(x, op='sum'):
    """Sum (or max) a Python float over ranks."""
    if world_size() == 1:
        return x
    t = torch.tensor([float(x)], dtype=torch.float64)
    torch.distributed.all_reduce(t, torch.distributed.ReduceOp.SUM if op == 'sum' else torch.distributed.ReduceOp.MAX)
    return float(t)


def sync_gradients(model):
    """Sum gradients over ranks: each rank's loss already carries the global normaliser."""
    if world_size() == 1:
        return
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a rank with no trained tokens in this mini-batch still takes part
            torch.distributed.all_reduce(p.grad)


def gather(items):
    """Concatenate a list from every rank (rank order)."""
    if world_size() == 1:
        return items
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, items)
    return [x for part in out for x in part]


def init_distributed(cfg):
    """torchrun: one process per device, gloo on CPU, nccl on CUDA. Exits 2 when there are fewer
    groups than processes (a rank without a group would have nothing to roll out)."""
    if int(os.environ.get('WORLD_SIZE', '1')) == 1:
        return False
    if cfg['oversample'] > 1:  # which groups to keep would need every rank's rewards
        fail("config key 'oversample' needs one process (torchrun runs several)")
    if cfg['batch_size'] < int(os.environ['WORLD_SIZE']):
        fail(f"config key 'batch_size' ({cfg['batch_size']}) must be at least the number of processes "
             f"({os.environ['WORLD_SIZE']}): each process rolls out whole groups")
    torch.distributed.init_process_group('nccl' if cfg['device'].startswith('cuda') else 'gloo')
    if cfg['device'].startswith('cuda'):
        cfg['device'] = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(cfg['device'])
    return True
