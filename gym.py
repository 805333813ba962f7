"""
The gym contract and its enforcement, loading a gym by name, token owners and formats (how text
becomes ids), the word tokenizer of the tiny model, and JSONL data files. What only the QA gyms share
(EM/F1, answer rewards, the <mem> turn format) is in gyms/answers.py.

A gym is a module gyms/<name>.py, chosen by `gym: <name>` in a config. It defines
    MODEL   'tiny': the gym builds its own word vocabulary and needs model: tiny;
            'hf': it needs a Hugging Face chat model (tiny-qwen3, smollm2, a name or a path);
            'any': either (the memory gym: its own words for tiny, the model's chat template otherwise)
    KEYS    the gym-specific config keys it reads (config.py marks them `gym:`); load_gym refuses a
            gym-specific key that another gym reads, set here to a value other than its default
    TASK_KEYS (optional) those of KEYS that change its held-out or validation tasks: --resume refuses
            a change to them, as to seed, eval_tasks and val_tasks (the scores would not compare)
    setup(cfg, vocab=None) -> dict with
        tok           a WordTokenizer (MODEL 'tiny') or a Hugging Face tokenizer
        fmt           a Format: word_format(tok, ...) or hf.chat_format(tok, ...)
        train_tasks   non-empty lists of tasks (any objects the env's reset takes); eval_tasks are
        eval_tasks    the held-out ones (an optional val_tasks: a validation split; an optional rl_tasks:
                      the training tasks RL draws from, default train_tasks, which the warm start imitates)
        make_env      () -> a fresh env
        warm_policy   rng -> a scripted policy (episode -> action text) to warm-start from, or None;
                      a turn it returns as (text, False) is played but not trained on (a mistake)
        baselines     {name: exact held-out success rate} of reference policies, may be empty
        answer_text   task -> the gold answer as the policy writes it ('<answer> a1 ; a2 </answer>'),
                      or None: the turns write no <mem> and mem_coef must be 0. A gym that has one
                      defines it as a module function answer_text(task), so that load_gym can refuse
                      mem_coef > 0 before setup
    vocab is the word list a checkpoint saved (WordTokenizer.itos): a MODEL 'tiny' gym passes it to
    build_tokenizer(texts, vocab), so that every id means what it meant in training.

An env (make_env()) has
    reset(task) -> the prompt text
    step(action_text, finish='stop') -> (observation text, reward float, done bool, info dict)
        reward is the episode's outcome, given with done=True (0 before). The observation that comes
        with done=True is never shown to the policy, so it is not read (None or '' will do). action_text is the
        policy's decoded turn. finish is 'length' when the turn reached max_response_tokens without
        its stop token: the env then runs no tool and answers as to a malformed turn (a turn used).
        When done, info holds `success` (bool, the task solved) and `stop` (one of STOPS). info may
        hold `turn_ok` (bool): whether this turn kept the gym's turn format (default: it ended with
        its stop token); MemPO's memory reward scores only such turns.
The rollout itself ends an episode 'max_len' (its next context would not fit), 'max_turns' (its turn
cap) or 'env_error' (step raised: the episode is invalid), each with reward 0; every other stop is the
gym's, and a gym that ends an episode on its own turn limit says 'budget'. rollout.py calls an env only
through checked_reset and checked_step below, which hold the contract.
"""

import difflib
import importlib
import json
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# every stop reason an episode can end with (info['stop']); the last three mean it was cut: out of
# context (the rollout's max_len), out of the rollout's max_turns, or out of the gym's own turn budget
STOPS = ('answer', 'submit', 'over', 'env_error', 'max_len', 'max_turns', 'budget')
TRUNCATED = STOPS[-3:]
OWNER = {'template': 0, 'prompt': 1, 'policy': 2, 'tool': 3}  # who wrote a token


class GymContractError(ValueError):
    """A gym broke the contract above: train.py stops with one line naming the env class."""


def checked_reset(env, task):
    """env.reset(task): the prompt text. Raises GymContractError when reset raises (naming the task)
    or returns anything but a str."""
    try:
        text = env.reset(task)
    except Exception as e:
        raise GymContractError(f"{type(env).__name__}.reset raised {type(e).__name__}: {e} "
                               f"(task {getattr(task, 'name', task)!r})") from e
    if not isinstance(text, str):
        raise GymContractError(f"{type(env).__name__}.reset returned {type(text).__name__}, not the prompt text (str)")
    return text


def checked_step(env, action, finish):
    """env.step(action, finish) -> (observation, reward, done, info), held to the contract.

    An env that raises ends its episode: done, reward 0, info with stop 'env_error', the error and
    invalid=True (the episode is left out of the update, not the run). A final reward that is not a
    finite number (None, NaN, '1', True) likewise: reward 0, not a success, invalid, the error named;
    a NaN would poison its group's mean and std. info always holds turn_ok. Raises GymContractError (the gym is
    broken in every episode) for a result that is not a 4-tuple, a finished episode's info without
    success or a stop in STOPS, an info that is not a dict, a reward before done, or an observation that
    is not text before done (at done it is not read)."""
    name = type(env).__name__
    try:
        out = env.step(action, finish)
    except Exception as e:
        return '', 0.0, True, dict(error=f'{type(e).__name__}: {e}', invalid=True, stop='env_error', success=False,
                                   turn_ok=False)
    if not (isinstance(out, tuple) and len(out) == 4):
        raise GymContractError(f"{name}.step returned {type(out).__name__}"
                               f"{f' of {len(out)}' if isinstance(out, tuple) else ''}, not (observation, reward, done, info)")
    obs, reward, done, info = out
    if info is not None and not isinstance(info, dict):
        raise GymContractError(f"{name}.step returned info of type {type(info).__name__}, not a dict")
    if done:
        missing = [k for k in ('success', 'stop') if not isinstance(info, dict) or k not in info]
        if missing:
            raise GymContractError(f"{name}.step returned done=True without info[{missing[0]!r}] (gym.py: a finished "
                                   f"episode's info holds success and stop)")
        if info['stop'] not in STOPS:
            raise GymContractError(f"{name}.step returned done=True with info['stop']={info['stop']!r}, not one of "
                                   f"gym.STOPS ({', '.join(STOPS)})")
        info = dict(info)
        is_number = isinstance(reward, numbers.Real) and not isinstance(reward, bool)  # numpy's too; not '1', not True
        if not (is_number and math.isfinite(reward)):
            info.setdefault('error', f'reward {reward!r} is not a finite number' if is_number else
                            f'reward {reward!r} is a {type(reward).__name__}, not a number (int or float)')
            reward, info['invalid'], info['success'] = 0.0, True, False  # not counted a success either
    elif reward != 0:  # the outcome is per episode: a reward before done would be dropped without a word
        raise GymContractError(f"{name}.step returned reward {reward!r} before done; rewards are per episode, "
                               f"given with done=True")
    elif not isinstance(obs, str):  # encoding it would fail deep inside the tokenizer
        raise GymContractError(f"{name}.step returned an observation of type {type(obs).__name__}, not text (str)")
    info = dict(info or {})
    info.setdefault('turn_ok', finish == 'stop')
    return obs, float(reward), done, info


def scripted_turn(policy, episode):
    """A scripted (warm_policy) policy's next turn -> (text, train): text alone trains; (text, False)
    is a mistake to play but not train on. A policy that raises, or returns anything else, raises
    GymContractError (one line, naming it)."""
    try:
        said = policy(episode)
    except Exception as e:
        raise GymContractError(f"the gym's scripted policy raised {type(e).__name__}: {e}") from None
    text, train = said if isinstance(said, tuple) and len(said) == 2 else (said, True)
    if not isinstance(text, str) or train not in (True, False):
        raise GymContractError(f"a scripted policy returned {said!r}; it returns the turn's text, or "
                               f"(text, False) for a mistake not to train on")
    return text, train


def check_prompts_fit(gym_, cfg):
    """Raise ValueError when some task's first context (its prompt and fmt.turn_prefix) plus
    max_response_tokens exceeds max_len: the rollout would end that episode 'max_len' before its
    first turn. Resets a fresh make_env() per task (cheap: 16096 tasks take 0.1 s). Returns the
    longest first context in tokens."""
    fmt, tasks = gym_['fmt'], list(gym_['train_tasks']) + list(gym_['eval_tasks'])
    longest = max((len(fmt.prompt(checked_reset(gym_['make_env'](), t))[0]) for t in tasks), default=0) + len(fmt.turn_prefix)
    if longest + cfg['max_response_tokens'] > cfg['max_len']:
        raise ValueError(f"max_len={cfg['max_len']} is too short: the longest prompt is {longest} tokens and a "
                         f"turn needs max_response_tokens={cfg['max_response_tokens']} more")
    return longest

# -----------------------------------------------------------------------------
# loading a gym

GYMS = Path(__file__).resolve().parent / 'gyms'
SETUP_KEYS = ('tok', 'fmt', 'train_tasks', 'eval_tasks', 'make_env', 'warm_policy', 'baselines', 'answer_text')


def fail(msg):
    """Print one line `error: msg` to stderr and exit with status 2 (bad input, nothing lost). config.py
    and the scripts use this one (gym.py imports nothing of ours, so every room can)."""
    print(f'error: {msg}', file=sys.stderr)
    sys.exit(2)


def gym_modules(broken=None):
    """{name: module} of every gyms/<name>.py that defines setup, by name (gyms/sandbox.py is a tool).
    A file that does not import is left out, so one half-written gym cannot stop the others; its
    error goes into `broken` ({name: one line}) when a dict is given."""
    mods = {}
    for path in sorted(GYMS.glob('[!_]*.py')):
        try:
            mod = importlib.import_module(f'gyms.{path.stem}')
        except Exception as e:  # a syntax error, a missing package: reported only when this gym is asked for
            if broken is not None:
                broken[path.stem] = f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
            continue
        if hasattr(mod, 'setup'):
            mods[path.stem] = mod
    return mods


def gym_module(cfg, defaults=None):
    """The module of gym cfg['gym'], after the checks that need no setup: an unknown or broken gym, a
    model of the wrong kind, a gym-specific key this gym does not read set away from its default (with
    defaults, the config defaults), mem_coef > 0 in a gym without <mem>. Each exits 2 with one line."""
    broken = {}
    name, gyms = cfg['gym'], gym_modules(broken)
    if name in broken:
        fail(f"gyms/{name}.py does not import: {broken[name]}")
    if name not in gyms:
        close = difflib.get_close_matches(name, gyms, n=1)
        fail(f"unknown gym {name!r}" + (f" (did you mean {close[0]!r}?)" if close else '') + f"; the gyms: {', '.join(gyms)}")
    mod = gyms[name]
    for attr in ('MODEL', 'KEYS'):
        if not hasattr(mod, attr):
            fail(f"gyms/{name}.py defines no {attr} (gym.py lists what a gym module defines)")
    if mod.MODEL not in ('tiny', 'hf', 'any'):
        fail(f"gyms/{name}.py: MODEL is {mod.MODEL!r}; it must be 'tiny', 'hf' or 'any'")
    task_keys = getattr(mod, 'TASK_KEYS', ())
    if not isinstance(task_keys, tuple) or not set(task_keys) <= set(mod.KEYS):
        fail(f"gyms/{name}.py: TASK_KEYS is {task_keys!r}; it must be a tuple of its KEYS")
    if mod.MODEL == 'tiny' and cfg['model'] != 'tiny':
        fail(f"gym {name!r} builds its own word vocabulary for model: tiny, not {cfg['model']!r}")
    if mod.MODEL == 'hf' and cfg['model'] == 'tiny':
        fail(f"gym {name!r} needs a Hugging Face chat model (model: tiny-qwen3, smollm2 or a name/path)")
    if defaults and set(mod.KEYS) - set(defaults):
        fail(f"gyms/{name}.py lists {sorted(set(mod.KEYS) - set(defaults))[0]!r} in KEYS, but config.py has no default for it")
    for key in sorted({k for m in gyms.values() for k in getattr(m, 'KEYS', ())} - set(mod.KEYS)) if defaults else []:
        if key in defaults and cfg[key] != defaults[key]:  # set on purpose, yet this gym would silently ignore it
            fail(f"config key {key!r} is not used by gym {name!r}")
    if cfg['mem_coef'] > 0 and getattr(mod, 'answer_text', None) is None:
        mem = ', '.join(n for n, m in gyms.items() if getattr(m, 'answer_text', None) is not None)
        fail(f"config key 'mem_coef' ({cfg['mem_coef']}) needs a gym whose turns write <mem> ({mem}), not {name!r}")
    return mod


def load_gym(cfg, vocab=None, defaults=None):
    """Set up the gym cfg['gym'] -> the dict its setup returns (see the contract above), its eval_tasks
    cut to the first cfg['eval_tasks'] (0 = all).

    vocab: a checkpoint's tiny vocabulary (list of words) or None. defaults: the config defaults
    (config.config), for gym_module's key check. Every error exits with status 2 and one line: those
    of gym_module, bad data (OSError or ValueError from setup), setup's result not a dict or missing a
    key, an empty split, more eval_tasks asked for than the gym has, a checkpoint vocabulary without
    some word of the gym's texts, a reset that raises or a prompt too long for max_len (check_prompts_fit)."""
    mod, name = gym_module(cfg, defaults), cfg['gym']
    try:
        gym_ = mod.setup(cfg, vocab)
    except (OSError, ValueError) as e:  # bad data or settings stop here, before any training
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if not isinstance(gym_, dict):
        fail(f"gym {name!r}: setup returned {type(gym_).__name__}, not a dict (gym.py lists what setup returns)")
    for key in SETUP_KEYS:
        if key not in gym_:
            fail(f"gym {name!r}: setup returned no {key!r} (gym.py lists what setup returns)")
    gym_.setdefault('rl_tasks', gym_['train_tasks'])
    for key, split in (('train_tasks', 'train'), ('rl_tasks', 'RL'), ('eval_tasks', 'held-out')):
        if not gym_[key]:
            fail(f"gym {name!r} has an empty {split} split")
    if cfg.get('sft_coef') and gym_['warm_policy'] is None:  # before any evaluation, not at the first RL step
        fail(f"config key 'sft_coef' imitates the gym's scripted policy; gym {name!r} has none")
    if cfg.get('eval_tasks', 0) > len(gym_['eval_tasks']):  # a silent cap would report fewer tasks than asked
        fail(f"config key 'eval_tasks' asks for {cfg['eval_tasks']} held-out tasks; gym {name!r} has "
             f"{len(gym_['eval_tasks'])} (0 = all of them)")
    if cfg.get('eval_tasks'):  # the first eval_tasks, also where setup returned all it has (the example gym)
        gym_['eval_tasks'] = gym_['eval_tasks'][:cfg['eval_tasks']]
    missing = getattr(gym_['tok'], 'missing', None)
    if missing:
        fail(f"the checkpoint's vocabulary lacks {len(missing)} words of gym {name!r} (e.g. {missing[0]!r})")
    try:
        check_prompts_fit(gym_, cfg)
    except ValueError as e:  # GymContractError too: a reset that returns no text
        fail(str(e).splitlines()[0])
    return gym_

# -----------------------------------------------------------------------------
# formats: how text becomes ids for one kind of model


@dataclass
class Format:
    """How text becomes ids. prompt(text) and observation(text) return (ids, owners); a prompt ends
    where the policy's first turn starts, an observation sits between a policy turn and the next.
    turn_prefix is forced at the start of every policy turn (template tokens, e.g. <mem>)."""
    prompt: Callable
    observation: Callable
    decode: Callable
    encode: Callable              # only for scripted (text) policies and gold answers, never for samples
    stop_ids: list
    pad_id: int
    turn_prefix: list = field(default_factory=list)
    mem_span: Callable = None     # response ids -> length of its memory span through </mem> (0: none)
    fold_close: list = field(default_factory=list)  # template ids closing a folded memory turn
    end_turn: list = field(default_factory=list)    # ids the rollout appends to a scripted turn's text: a chat
                                                    # model's end-of-turn token (a word format's stops are tags)


def word_format(tok, memory=False):
    """The tiny model's format: `<bos> prompt`, then per turn the policy's words (ending with its stop
    token) and `<obs> observation </obs>`. With memory every turn is forced to open with <mem> and
    ends with </search> or </answer>; without, a turn is a call ending with </call>."""
    T, P, X = OWNER['template'], OWNER['prompt'], OWNER['tool']

    framing = {tok.pad_id, tok.bos_id, tok.obs_id, tok.obs_end_id}

    def data_ids(text):  # a framing word inside data (an echoed call) is <unk>: only the format frames
        return [tok.unk_id if i in framing else i for i in tok.encode(text)]

    def prompt(text):
        ids = data_ids(text)
        return [tok.bos_id] + ids, [T] + [P] * len(ids)

    def observation(text):
        ids = data_ids(text)
        return [tok.obs_id] + ids + [tok.obs_end_id], [T] + [X] * len(ids) + [T]

    def mem_span(response):
        end = tok.stoi['</mem>']
        return response.index(end) + 1 if end in response else 0

    stops = ['</search>', '</answer>'] if memory else ['</call>']
    return Format(prompt=prompt, observation=observation, decode=tok.decode, encode=tok.encode,
                  stop_ids=[tok.stoi[s] for s in stops], pad_id=tok.pad_id,
                  turn_prefix=[tok.stoi['<mem>']] if memory else [], mem_span=mem_span if memory else None)

# -----------------------------------------------------------------------------
# the word-level tokenizer of the tiny model

SPECIALS = ['<pad>', '<bos>', '<unk>', '<obs>', '</obs>', '<call>', '</call>', '<nl>', '<mem>', '</mem>',
            '<search>', '</search>', '<answer>', '</answer>', '<think>', '</think>']


class OutOfVocabulary(ValueError):
    """A text with a word the tiny model's vocabulary lacks (WordTokenizer.encode)."""


class WordTokenizer:
    """Word level: one whitespace-separated word is one id; a newline is the word <nl>. Specials have
    the fixed ids 0..15 (SPECIALS order). The vocabulary is closed: a gym lists every word it can
    show, and encoding any other word raises (<unk> is produced only where an observation holds a framing word: word_format)."""

    def __init__(self, words):
        self.itos = list(dict.fromkeys(SPECIALS + list(words)))
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.unk_id = 0, 1, 2
        self.obs_id, self.obs_end_id, self.call_id, self.call_end_id = 3, 4, 5, 6
        self.missing = []  # words of the gym's texts that a checkpoint's vocabulary lacks (build_tokenizer)

    @property
    def vocab_size(self):
        return len(self.itos)

    def encode(self, text):
        """str -> list[int]; a one-word-per-id split, so there is never more than one tokenisation.
        Raises OutOfVocabulary (a ValueError) naming the first word that is not in the vocabulary."""
        try:
            return [self.stoi[w] for w in text.replace('\n', ' <nl> ').split()]
        except KeyError as e:
            raise OutOfVocabulary(f"word {e.args[0]!r} is not in the tiny vocabulary of this gym "
                                  "(add it to the gym's texts)") from None

    def decode(self, ids):
        """list[int] -> str, words joined by one space (<nl> stays a word: decode(encode(s)) == s for
        gym texts, which are single-spaced)."""
        return ' '.join(self.itos[i] for i in ids)


def build_tokenizer(texts, vocab=None):
    """WordTokenizer for every word of `texts` (list[str]). vocab None: the words plus the specials,
    sorted, so that the ids do not depend on the order of the texts. vocab (a checkpoint's itos):
    exactly those words and ids; words of `texts` it lacks are listed in .missing (load_gym refuses
    such a gym in one line)."""
    words = {w for t in texts for w in t.replace('\n', ' <nl> ').split()}
    if vocab is None:
        return WordTokenizer(sorted(words - set(SPECIALS)))
    tok = WordTokenizer(vocab)
    tok.missing = sorted(words - set(tok.itos))
    return tok

# -----------------------------------------------------------------------------
# data files

def read_jsonl(path):
    """[(line number, dict)] of a JSONL file; blank lines skipped. Raises FileNotFoundError, or
    ValueError naming file:line for a line that is not a JSON object."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{path}: no such file')
    rows = []
    with open(path, encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f'{path}:{n}: malformed JSON ({e.msg})') from None
            if not isinstance(row, dict):
                raise ValueError(f'{path}:{n}: expected a JSON object, got {type(row).__name__}')
            rows.append((n, row))
    return rows
