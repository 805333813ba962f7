"""
What only the question-answering gyms (memory, searchqa) share: EM/F1 scoring of answers, the answer
rewards, and MemPO's turn format (<mem> [<think>] then one <search> or <answer>) with its parser.
"""

import re
import unicodedata
from collections import Counter

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
