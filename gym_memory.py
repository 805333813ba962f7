"""
The memory gym (MemPO for the tiny model) and the answer scoring shared with the real-model gyms.

Contents, top to bottom:
- answer scoring: normalize_answer, em, f1, score_answers ("a1 ; a2" multi-objective answers)
- turn format: validate_format, extract_answer, extract_mem
- worlds and tasks: make_tasks (each task draws its own random world of facts)
- MemoryEnv: reset / step, one `search` fact per call, reward = objectives answered exactly
- scripted policies (oracle / any_answer / random) and play(), which drives one with folded context
- vocabulary helpers for the word tokenizer: memory_texts, gold_answer_text

What it deliberately simplifies:
1. Search is an exact key lookup on (entity, relation), not BM25: the query must be exactly
   `entity rel1 rel2` (e.g. `moonfall directed by`). Exact lookup makes the skill "copy the pending
   hop from <mem> into <search>" learnable by a tiny model; ranking would add noise, not skill.
2. Every name is one lower-case word and every relation is two words, so facts are always four
   words (`moonfall directed by ada`) and the tiny whitespace tokenizer needs no sub-words.
3. Questions are noun chains, outermost relation first ("country of birthplace of director of
   moonfall"); several objectives are joined with ` ; ` and answered in the same order.
4. The format is strict: nothing but whitespace may stand outside the tags of a turn. A chat model's
   end-of-turn token must be stripped by its gym before calling validate_format.
"""

import random
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

# -----------------------------------------------------------------------------
# answer scoring

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SIGN = re.compile(r"(?<![\w.])[-\u2010\u2012\u2013\u2212](?=\d)")  # a minus/dash before a digit, not after a word
_NUM_DOT = re.compile(r"(?:(?<=\d)|(?<![\w.]))\.(?=\d)")              # a decimal point: 1.5, .5


def normalize_answer(s):
    """Canonical form of an answer string for EM/F1.

    Unicode NFKC (composed accents, full-width forms), case-folded (str.casefold: "Straße" ==
    "STRASSE"), every Unicode punctuation character (category P*: hyphens and en/em dashes, curly
    quotes, ...) deleted, the articles a/an/the removed unless nothing else is left ("A" stays "a"),
    whitespace collapsed to single spaces. Never raises on a str.

    Unlike SQuAD's normaliser, which strips all punctuation (so "10.8" == "108" and "-5" == "5"),
    numbers keep their identity: a decimal point (1.5, .5) and a leading sign are kept, and a sign
    written as U+2212 or a dash becomes "-". A thousands comma is deleted like other punctuation
    ("9,984" == "9984"), as is a period that ends a sentence ("5." == "5"). Symbols (S*: $ % + °)
    are kept, as before.
    """
    s = unicodedata.normalize("NFKC", s).casefold()
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

# -----------------------------------------------------------------------------
# turn format

TAGS = ("mem", "think", "search", "answer")
_TAG_RE = re.compile(r"<(/?)(mem|think|search|answer)>")


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


def _check_turn(text, require_think):
    """(action, reason): action is 'search'/'answer' for a well-formed turn, else None."""
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
        action, reason = _check_turn(text, require_think)
        if action is None:
            return False, f"turn {i + 1}: {reason}"
        last = i == len(turns) - 1
        if action == "answer" and not last:
            return False, f"turn {i + 1}: answer before the last turn"
        if action == "search" and last:
            return False, "episode does not end with an answer"
    return True, "ok"


def _extract(text, tag):
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
    if len(found) != 1 or _TAG_RE.search(found[0]):
        return None
    return found[0].strip()


def extract_answer(turn_text):
    """The answer in ONE turn's text (pass the policy's own last turn, never a prompt or an
    observation): the stripped content of its single <answer> block, or None when the turn has
    zero or several answer blocks or tags inside the answer. Never raises on a str."""
    return _extract(turn_text, "answer")


def extract_mem(turn_text):
    """The stripped content of the single <mem> block of one turn, or None (as extract_answer)."""
    return _extract(turn_text, "mem")

# -----------------------------------------------------------------------------
# worlds and tasks

# name pools shared by every split: a word-level model can only write names it has produced in
# training, so held-out tasks differ by world (which facts hold), never by vocabulary
PEOPLE = ("ada bo cyd dag eli fen gus hal ivo jon kai lev mia ned ola pia quin rex sol tia ugo "
          "vera wim yan").split()
CITIES = "varn tolk brisa olmen quess darrow fenby kastel lorna mirov pell rudd sarno tibo ulme wexa".split()
COUNTRIES = "arvenia belmora castor dunmark esland falvia gorith hesper".split()
WORKS = "moonfall ironbay redtide glasshour stormkey duskmere pinewake oldfire silverhorn quietsea " \
        "blackpool hollowsun".split()
ORGS = "acme zenco orbix vantor kelsa lumora nexar quilla".split()
POOLS = dict(person=PEOPLE, city=CITIES, country=COUNTRIES, work=WORKS, org=ORGS)
WORLD_SIZE = dict(person=6, city=4, country=3, work=3, org=3)  # entities drawn per episode

# relation phrase (two words, as in facts and searches) -> (subject type, object type, noun)
RELATIONS = {
    "directed by": ("work", "person", "director"),
    "produced by": ("work", "org", "producer"),
    "founded by": ("org", "person", "founder"),
    "based in": ("org", "city", "headquarters"),
    "born in": ("person", "city", "birthplace"),
    "married to": ("person", "person", "spouse"),
    "located in": ("city", "country", "country"),
}
NOUN_TO_REL = {noun: rel for rel, (_, _, noun) in RELATIONS.items()}
NO_RESULT = "no result"
BAD_FORMAT = "error : bad format"


@dataclass
class MemoryTask:
    id: str
    question: str            # "country of birthplace of director of moonfall ; founder of acme"
    golds: list              # k alias lists, [["arvenia"], ["bo"]]
    facts: dict              # "moonfall directed by" -> "ada": the whole world of this episode
    hops: list = field(default_factory=list)  # hops per objective


def _make_world(rng):
    """Random world: every entity has exactly one object per relation of its type."""
    ents = {t: rng.sample(POOLS[t], n) for t, n in WORLD_SIZE.items()}
    facts = {}
    for rel, (subj, obj, _) in RELATIONS.items():
        if rel == "married to":
            continue
        for e in ents[subj]:
            facts[f"{e} {rel}"] = rng.choice(ents[obj])
    people = list(ents["person"])
    rng.shuffle(people)
    for a, b in zip(people[::2], people[1::2]):  # marriage is symmetric: pair people up
        facts[f"{a} married to"], facts[f"{b} married to"] = b, a
    return ents, facts


def _chains(n_hops):
    """All type-valid relation chains of length n_hops (spouse of spouse excluded: it is X)."""
    out = [[r] for r in RELATIONS]
    for _ in range(n_hops - 1):
        out = [c + [r] for c in out for r in RELATIONS
               if RELATIONS[r][0] == RELATIONS[c[-1]][1] and not (r == c[-1] == "married to")]
    return out


def _question(root, chain):
    """'country of birthplace of director of moonfall' for root moonfall, chain directed by, born in, located in."""
    return " of ".join([RELATIONS[r][2] for r in reversed(chain)] + [root])


def _resolve(facts, root, chain):
    e = root
    for r in chain:
        e = facts[f"{e} {r}"]
    return e


def make_tasks(split, n, seed=0, n_objectives=None, hops=(2, 3)):
    """n memory tasks of one split, each with its own world.

    split: 'train' or 'heldout' (different seed streams, so different worlds).
    n_objectives: (lo, hi) inclusive range of sub-questions per task; default (1, 4) for train and
    (1, 5) for heldout, which so also tests one more objective than training saw. hops: (lo, hi)
    inclusive hops per sub-question.
    Returns list[MemoryTask]; deterministic in (split, n, seed, ranges). Raises ValueError on an
    unknown split.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    if n_objectives is None:
        # a tiny model does not extrapolate far in question length: after training on k <= 3, the
        # warm-started agent began 58 of 60 held-out k=4 episodes on the wrong objective (both agents
        # see the same first turn). Train up to 4, hold out up to 5: k=5 is the one-more test.
        n_objectives = (1, 4) if split == "train" else (1, 5)
    chains = {h: _chains(h) for h in range(hops[0], hops[1] + 1)}
    tasks = []
    for i in range(n):
        rng = random.Random(f"memory:{split}:{seed}:{i}")  # str seeds are stable across runs
        ents, facts = _make_world(rng)
        k = rng.randint(*n_objectives)
        questions, golds, hs, roots = [], [], [], []
        while len(questions) < k:
            h = rng.randint(*hops)
            chain = rng.choice(chains[h])
            root = rng.choice(ents[RELATIONS[chain[0]][0]])
            q = _question(root, chain)
            if root not in roots:  # distinct roots (so distinct sub-questions): the oracle's <mem> finds its objective by root
                roots.append(root)
                questions.append(q)
                golds.append([_resolve(facts, root, chain)])
                hs.append(h)
        tasks.append(MemoryTask(f"memory-{split}-{seed}-{i}", " ; ".join(questions), golds, facts, hs))
    return tasks


def gold_answer_text(task):
    """The gold answer exactly as the policy writes it: '<answer> a1 ; a2 </answer>'."""
    return "<answer> " + " ; ".join(g[0] for g in task.golds) + " </answer>"

# -----------------------------------------------------------------------------
# environment


class MemoryEnv:
    """One episode of the memory gym (see the env protocol in the repo spec).

    step(action_text): action_text is what the policy wrote after the forced `<mem>` prefix,
    e.g. 'moonfall directed by </mem> <search> moonfall directed by </search>'.
    - well-formed search: observation = the fact sentence ('moonfall directed by ada') or 'no result'
    - well-formed answer: ends the episode; reward = em_count (0..k) if the WHOLE episode passes
      validate_format, else 0.0
    - malformed turn: observation 'error : bad format', counted in n_invalid; the episode goes on
      but its final reward will be 0 (the format check covers every turn). A turn cut at the
      response limit (finish='length') is malformed whatever its text (its text fails the format
      check anyway: a well-formed turn ends with a stop token, </search> or </answer>)
    - own budget: after max_turns turns without an answer the episode ends (stop='max_turns', 0).
    """

    def __init__(self, max_turns=None, require_think=False):
        self.max_turns, self.require_think = max_turns, require_think

    def reset(self, task):
        """Start an episode; returns the prompt (the question words)."""
        self.task, self.turns, self.n_invalid, self.cut = task, [], 0, []
        self.budget = self.max_turns or 2 + sum(task.hops)
        return task.question

    def step(self, action_text, finish="stop"):
        """Returns (obs: str, reward: float, done: bool, info: dict). Never raises on a str.
        finish: 'stop' or 'length' (cut at the response limit: a malformed turn)."""
        text = "<mem> " + action_text
        self.turns.append(text)
        action = _check_turn(text, self.require_think)[0] if finish != "length" else None
        if finish == "length":
            self.cut.append(len(self.turns))
        info = dict(n_turns=len(self.turns), n_invalid=self.n_invalid)
        if action == "answer":
            return "", *self._finish("answer", extract_answer(text))
        if action == "search":
            query = " ".join(_extract(text, "search").split())
            obs = f"{query} {self.task.facts[query]}" if query in self.task.facts else NO_RESULT
        else:
            self.n_invalid += 1
            obs = BAD_FORMAT
        if len(self.turns) >= self.budget:
            return obs, *self._finish("max_turns", None)
        info["n_invalid"] = self.n_invalid
        return obs, 0.0, False, info

    def _finish(self, stop, answer):
        golds = self.task.golds
        s = score_answers(answer, golds) if answer is not None else dict(em_count=0, em=0.0, f1=0.0, k=len(golds))
        ok, reason = validate_format(self.turns, self.require_think)
        if ok and self.cut:  # a cut turn whose text happens to be well formed still breaks the format
            ok, reason = False, f"turn {self.cut[0]}: cut at the response length limit"
        reward = float(s["em_count"]) if ok and stop == "answer" else 0.0
        # success = every objective right AND a valid format: what the reward pays for in full
        info = dict(stop=stop, success=reward == s["k"], n_turns=len(self.turns), n_invalid=self.n_invalid,
                    format_ok=ok, format_reason=reason, answer=answer, **s)
        return reward, True, info

# -----------------------------------------------------------------------------
# scripted policies: each sees ONLY (question, last mem content or None, last observation or None),
# exactly the context MemPO's folding keeps, and returns the text after the forced `<mem>`.
#
# The oracle's <mem> is canonical: the answers found so far, then the pending segment of the current
# objective, separated by ' ; '. The pending segment is the objective's root, the entity reached so
# far and the hops left: 'arvenia ; acme ada born in located in' = objective 1 answered, objective 2
# (the one whose root is acme) is at entity ada with 'born in', 'located in' left. The next search
# is the entity and the first hop (words 2-4 of the segment). When the last hop is found, the segment
# becomes the answer alone and, in the same turn, the objective after the one with that root in the
# question is opened (its root written twice: root and entity). Keeping the root is what lets a tiny
# model find the next objective by content (the question segment after the one ending with this root)
# instead of by counting segments: without it, the folded agent's commonest error was opening the
# wrong next objective (40 of 49 failed held-out k=2 episodes of one seed), and counting does not
# extend to more objectives than training showed. make_tasks keeps roots distinct within a question.


def _pending_chain(sub_question):
    """'country of birthplace of director of moonfall' -> 'moonfall moonfall directed by born in located in'."""
    words = sub_question.split(" of ")
    return " ".join([words[-1], words[-1]] + [NOUN_TO_REL[w] for w in reversed(words[:-1])])


def _next_objective(objectives, root):
    """The objective after the one whose root is `root`, or None (last one, or no such root)."""
    roots = [q.split()[-1] for q in objectives]
    i = roots.index(root) + 1 if root in roots else len(roots)
    return objectives[i] if i < len(objectives) else None


def oracle_mem(question, mem, obs):
    """The oracle's next <mem> content (str) from the folded context."""
    objectives = question.split(" ; ")
    segs = [s.split() for s in mem.split(";")] if mem else []
    fact = (obs or "").split()
    # fold the last observation into the pending segment: 'root e r1 r2 rest' + fact 'e r1 r2 o' -> 'root o rest'
    if segs and len(segs[-1]) >= 4 and len(fact) == 4 and segs[-1][1:4] == fact[:3]:
        segs[-1] = segs[-1][:1] + [fact[3]] + segs[-1][4:]
    if not segs:
        segs.append(_pending_chain(objectives[0]).split())
    elif len(segs[-1]) == 2:  # 'root answer': objective done, open the next one
        root, segs[-1] = segs[-1][0], segs[-1][1:]
        nxt = _next_objective(objectives, root)
        if nxt is not None:
            segs.append(_pending_chain(nxt).split())
    return " ; ".join(" ".join(s) for s in segs)


def oracle_policy(question, mem, obs):
    """Correct mem, next needed hop, answer when every objective is resolved."""
    new = oracle_mem(question, mem, obs)
    segs = [s.split() for s in new.split(" ; ")]
    if all(len(s) == 1 for s in segs):
        return f"{new} </mem> <answer> {new} </answer>"
    return f"{new} </mem> <search> {' '.join(segs[-1][1:4])} </search>"


def any_answer_policy(question, mem, obs):
    """Baseline: answers at once with the root entity of every objective (always wrong type)."""
    roots = " ; ".join(q.split()[-1] for q in question.split(" ; "))
    return f"{roots} </mem> <answer> {roots} </answer>"


def make_random_policy(rng):
    """Baseline: well-formed turns of random words from the context; answers with p=0.2."""
    def policy(question, mem, obs):
        words = (question + " " + (obs or "")).replace(";", " ").split()
        m = " ".join(rng.choice(words) for _ in range(3))
        if rng.random() < 0.2:
            return f"{m} </mem> <answer> {rng.choice(words)} </answer>"
        return f"{m} </mem> <search> {rng.choice(words)} {rng.choice(list(RELATIONS))} </search>"
    return policy


def play(task, policy, env=None):
    """Run one episode, giving the policy only (question, last mem, last obs) each turn.
    Returns (turns: list[str] of action texts, observations: list[str], reward: float, info: dict)."""
    env = env or MemoryEnv()
    question = env.reset(task)
    mem = obs = None
    turns, observations = [], []
    while True:
        action = policy(question, mem, obs)
        obs, reward, done, info = env.step(action)
        turns.append(action)
        observations.append(obs)
        mem = extract_mem("<mem> " + action)
        if done:
            return turns, observations, reward, info

# -----------------------------------------------------------------------------
# vocabulary


def memory_texts():
    """Texts covering every word the gym can emit or the oracle can write (names, relation words
    and nouns, 'of', ';', messages, tags): build the word tokenizer's vocabulary from their words."""
    texts = [" ".join(p) for p in POOLS.values()]
    texts += list(RELATIONS) + [" ".join(NOUN_TO_REL), "of ;", NO_RESULT, BAD_FORMAT]
    texts += [" ".join(f"<{t}> </{t}>" for t in TAGS)]
    return texts
