"""
The gym contract, loading a gym by name, and what every gym shares: token owners and formats (how
text becomes ids), the word tokenizer of the tiny model, JSONL data files, answer scoring (EM/F1)
and the <mem> turn format.

A gym is a module gyms/<name>.py, chosen by `gym: <name>` in a config. It defines
    MODEL   'tiny': the gym builds its own word vocabulary and needs model: tiny;
            'hf': it needs a Hugging Face chat model (tiny-qwen3, smollm2, a name or a path);
            'any': either (the memory gym: its own words for tiny, the model's chat template otherwise)
    KEYS    the gym-specific config keys it reads (config.py marks them `gym:`); load_gym refuses a
            gym-specific key that another gym reads, set here to a value other than its default
    setup(cfg, vocab=None) -> dict with
        tok           a WordTokenizer (MODEL 'tiny') or a Hugging Face tokenizer
        fmt           a Format: word_format(tok, ...) or hf.chat_format(tok, ...)
        train_tasks   non-empty lists of tasks (any objects the env's reset takes); eval_tasks are
        eval_tasks    the held-out ones
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
        reward is the episode's outcome, given with done=True (0 before: GymContractError otherwise).
        action_text is the policy's decoded turn. finish is 'length' when the turn reached
        max_response_tokens without its stop token: the env then runs no tool and answers as to a
        malformed turn (a turn used). When done, info holds `success` (bool, the task solved) and
        `stop` (one of STOPS); rollout.py stops the run with a ValueError otherwise.
The rollout itself ends an episode 'truncated' (out of max_turns or max_len, reward 0) or 'env_error'
(step raised: the episode is invalid); every other stop is the gym's.
"""

import difflib
import importlib
import json
import os
import re
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# every stop reason an episode can end with (info['stop']); the last three mean it ran out of turns or context
STOPS = ('answer', 'submit', 'over', 'env_error', 'truncated', 'budget', 'max_turns')
TRUNCATED = STOPS[-3:]
OWNER = {'template': 0, 'prompt': 1, 'policy': 2, 'tool': 3}  # who wrote a token

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
    """Set up the gym cfg['gym'] -> the dict its setup returns (see the contract above).

    vocab: a checkpoint's tiny vocabulary (list of words) or None. defaults: the config defaults
    (config.config), for gym_module's key check. Every error exits with status 2 and one line: those
    of gym_module, bad data (OSError or ValueError from setup), a missing key in setup's dict, an
    empty split, more eval_tasks asked for than the gym has, a checkpoint vocabulary without some
    word of the gym's texts."""
    mod, name = gym_module(cfg, defaults), cfg['gym']
    try:
        gym_ = mod.setup(cfg, vocab)
    except (OSError, ValueError) as e:  # bad data or settings stop here, before any training
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    for key in SETUP_KEYS:
        if key not in gym_:
            fail(f"gym {name!r}: setup returned no {key!r} (gym.py lists what setup returns)")
    for key, split in (('train_tasks', 'train'), ('eval_tasks', 'held-out')):
        if not gym_[key]:
            fail(f"gym {name!r} has an empty {split} split")
    if cfg.get('eval_tasks', 0) > len(gym_['eval_tasks']):  # a silent cap would report fewer tasks than asked
        fail(f"config key 'eval_tasks' asks for {cfg['eval_tasks']} held-out tasks; gym {name!r} has "
             f"{len(gym_['eval_tasks'])} (0 = all of them)")
    missing = getattr(gym_['tok'], 'missing', None)
    if missing:
        fail(f"the checkpoint's vocabulary lacks {len(missing)} words of gym {name!r} (e.g. {missing[0]!r})")
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


class GymContractError(ValueError):
    """A gym broke the contract above (rollout.check_done_info): train.py stops with one line."""


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


# -----------------------------------------------------------------------------
# answers and the <mem> turn format, shared by the gyms whose turns are <mem> [<think>] then
# <search> or <answer> (MemPO)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SIGN = re.compile(r"(?<![\w.])[-\u2010\u2012\u2013\u2212](?=\d)")  # a minus/dash before a digit, not after a word
_NUM_DOT = re.compile(r"(?:(?<=\d)|(?<![\w.]))\.(?=\d)")              # a decimal point: 1.5, .5


def normalize_answer(s):
    """Canonical form of an answer string for EM/F1.

    Unicode NFKC (composed accents, full-width forms), every format character (category Cf: zero-width
    space, left-to-right mark, soft hyphen, ...) deleted, case-folded (str.casefold: "Straße" ==
    "STRASSE"), every Unicode punctuation character (category P*: hyphens and en/em dashes, curly
    quotes, ...) deleted, the articles a/an/the removed unless nothing else is left ("A" stays "a"),
    whitespace collapsed to single spaces. Never raises on a str.

    Unlike SQuAD's normaliser, which strips all punctuation (so "10.8" == "108" and "-5" == "5"),
    numbers keep their identity: a decimal point (1.5, .5) and a leading sign are kept, and a sign
    written as U+2212 or a dash becomes "-". A thousands comma is deleted like other punctuation
    ("9,984" == "9984"), as is a period that ends a sentence ("5." == "5"). Symbols (S*: $ % + °)
    are kept, as before.
    """
    # invisible marks ride along with spans copied from passages (HotpotQA's hold U+200E after Arabic
    # and Hebrew names): deleted first, so that they cannot split a word or part a sign from its digit
    s = unicodedata.normalize("NFKC", "".join(ch for ch in s if unicodedata.category(ch) != "Cf")).casefold()
    s = _SIGN.sub("-", s)
    keep = {m.start() for m in _SIGN.finditer(s)} | {m.start() for m in _NUM_DOT.finditer(s)}
    # deleting (not spacing) punctuation keeps "semi-final" == "semifinal", as SQuAD's scorer does
    s = "".join(ch for i, ch in enumerate(s) if i in keep or not unicodedata.category(ch).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", s).split()) or " ".join(s.split())


def _as_list(golds):
    return [golds] if isinstance(golds, str) else list(golds)


def em(pred, golds):
    """Exact match of one answer against gold aliases: 1.0 if the normalised pred equals any
    normalised gold, else 0.0. An answer that normalises to "" never matches (not even a gold
    that also normalises to ""): an empty <answer> must not earn reward. golds: str or list[str]."""
    p = normalize_answer(pred)
    if not p:
        return 0.0
    return float(any(p == normalize_answer(g) for g in _as_list(golds)))


def f1(pred, golds):
    """Token-level F1 (SQuAD style, on normalised words) of one answer, max over gold aliases.
    Returns a float in [0, 1]; an empty normalised pred or gold scores 0."""
    pt = normalize_answer(pred).split()
    best = 0.0
    for g in _as_list(golds):
        gt = normalize_answer(g).split()
        common = sum((Counter(pt) & Counter(gt)).values())
        if not pt or not gt or common == 0:
            continue
        prec, rec = common / len(pt), common / len(gt)
        best = max(best, 2 * prec * rec / (prec + rec))
    return best


def score_answers(pred, golds):
    """Score a multi-objective answer `a1 ; a2 ; ...` against k objectives.

    pred: the answer text (content of <answer>), split on ';'; part i is scored against objective i.
    Missing parts score 0; parts beyond k are ignored (position-aligned, so they cannot hedge).
    golds: list of k alias lists, e.g. [["oslo"], ["ada", "ada lovelace"]]; a flat list[str] is
    taken as one objective with those aliases.
    Returns dict(em_count: int 0..k, em: em_count / k, f1: mean per-objective F1, k: int).
    """
    golds = [golds] if golds and all(isinstance(g, str) for g in golds) else list(golds)
    k = len(golds)
    if k == 0:
        return dict(em_count=0, em=0.0, f1=0.0, k=0)
    parts = pred.split(";")
    parts += [""] * (k - len(parts))
    ems = [em(p, g) for p, g in zip(parts, golds)]
    f1s = [f1(p, g) for p, g in zip(parts, golds)]
    return dict(em_count=int(sum(ems)), em=sum(ems) / k, f1=sum(f1s) / k, k=k)


ANSWER_REWARDS = ('em', 'f1', 'all')


def check_answer_reward(answer_reward):
    """Returns answer_reward (one of ANSWER_REWARDS); raises ValueError naming the config key otherwise."""
    if answer_reward not in ANSWER_REWARDS:
        raise ValueError(f"config key 'answer_reward' expects one of {', '.join(ANSWER_REWARDS)}, got {answer_reward!r}")
    return answer_reward


def answer_reward(scores, how):
    """The reward of a well-formed answer from score_answers' dict, in points (0..k for k objectives):
    'em' the objectives answered exactly (MemPO's outcome reward: 1 point, 2 for a two-part question);
    'f1' the sum of their token F1 (partial credit for partial words); 'all' k when every objective is
    exactly right, else 0 (no credit for part of the answer, so answering before every objective is
    found earns nothing unless the guess is right)."""
    if how == 'all':
        return float(scores['k']) if scores['em_count'] == scores['k'] else 0.0
    return float(scores['em_count']) if how == 'em' else scores['f1'] * scores['k']


TAGS = ("mem", "think", "search", "answer")
_TAG_RE = re.compile(r"<(/?)(mem|think|search|answer)>")
END_MARKERS = ('<|im_end|>', '<|endoftext|>', '<|eot_id|>')  # chat models' end-of-turn tokens as text


def strip_end_marker(text):
    """A decoded turn without a trailing end-of-turn token (decoding normally skips it; a tokenizer
    that does not mark it special leaves it in the text) and the whitespace around it."""
    text = text.rstrip()
    for marker in END_MARKERS:
        if text.endswith(marker):
            return text[:-len(marker)].rstrip()
    return text


def _parse_turn(text):
    """Split one assistant turn into [(tag, content)] blocks, or return (None, reason)."""
    blocks, open_tag, pos, start = [], None, 0, 0
    for m in _TAG_RE.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        between = text[pos:m.start()]
        if open_tag is None:
            if between.strip():
                return None, "text outside tags"
            if closing:
                return None, f"unbalanced </{name}>"
            open_tag, start = name, m.end()
        else:
            if not closing:
                return None, f"nested <{name}> inside <{open_tag}>"
            if name != open_tag:
                return None, f"</{name}> closes <{open_tag}>"
            if not text[start:m.start()].strip():
                return None, f"empty <{name}>"
            blocks.append((name, text[start:m.start()].strip()))
            open_tag = None
        pos = m.end()
    if open_tag is not None:
        return None, f"unclosed <{open_tag}>"
    if text[pos:].strip():
        return None, "text outside tags"
    return blocks, "ok"


def check_turn(text, require_think):
    """One turn's full text -> (action, reason): action is 'search' or 'answer' for a well-formed
    turn (see validate_format), else None with the reason."""
    blocks, reason = _parse_turn(text)
    if blocks is None:
        return None, reason
    names = [b[0] for b in blocks]
    for n in TAGS:
        if names.count(n) > 1:
            return None, f"duplicated <{n}>"
    if not names or names[0] != "mem":
        return None, "missing <mem> at start"
    body = names[1:]
    if body and body[0] == "think":
        body = body[1:]
    elif require_think:
        return None, "missing <think>"
    if len(body) != 1 or body[0] not in ("search", "answer"):
        return None, "need exactly one <search> or <answer> after <mem>"
    return body[0], "ok"


def validate_format(turns, require_think=False):
    """Check the format of a whole episode.

    turns: list[str], every assistant turn's full text INCLUDING the forced `<mem>` prefix.
    Rules: each turn is `<mem>..</mem>` [`<think>..</think>`] then exactly one of
    `<search>..</search>` / `<answer>..</answer>`; `<think>` is required when require_think.
    Tags are balanced, not nested, not duplicated, and have non-blank content; nothing but
    whitespace stands outside the tags. Every turn but the last searches; the last one answers.
    Returns (ok: bool, reason: str) with reason 'ok' or e.g. 'turn 2: nested <search> inside <mem>'.
    Never raises on a list of str.
    """
    if not turns:
        return False, "no turns"
    for i, text in enumerate(turns):
        action, reason = check_turn(text, require_think)
        if action is None:
            return False, f"turn {i + 1}: {reason}"
        last = i == len(turns) - 1
        if action == "answer" and not last:
            return False, f"turn {i + 1}: answer before the last turn"
        if action == "search" and last:
            return False, "episode does not end with an answer"
    return True, "ok"


def score_episode(answer, golds, turns, require_think=False, cut=()):
    """An answer-and-<mem> episode's numbers: score_answers of the answer (all 0 when there is none),
    and whether its turns keep the format (validate_format; a turn cut at the response length limit,
    listed in cut, breaks it even when its text happens to be well formed). Returns (scores dict,
    format_ok, reason)."""
    s = score_answers(answer, golds) if answer is not None else dict(em_count=0, em=0.0, f1=0.0, k=len(golds))
    ok, reason = validate_format(turns, require_think)
    if ok and cut:
        ok, reason = False, f'turn {cut[0]}: cut at the response length limit'
    return s, ok, reason


def extract_tag(text, tag):
    """The stripped content of the single <tag> block of one turn, or None when there are zero or
    several such blocks or tags inside it."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
    if len(found) != 1 or _TAG_RE.search(found[0]):
        return None
    return found[0].strip()


def extract_answer(turn_text):
    """The answer in ONE turn's text (pass the policy's own last turn, never a prompt or an
    observation): the stripped content of its single <answer> block, or None when the turn has
    zero or several answer blocks or tags inside the answer. Never raises on a str."""
    return extract_tag(turn_text, "answer")


def extract_mem(turn_text):
    """The stripped content of the single <mem> block of one turn, or None (as extract_answer)."""
    return extract_tag(turn_text, "mem")

