"""
The memory gym: MemPO where memory must be learned, for the tiny model (its own word vocabulary) or
any chat model (the same worlds and texts through the model's chat template, SYSTEM_PROMPT saying
the turn format). Answer scoring (EM/F1 of "a1 ; a2" answers) and the
turn format (validate_format) are gyms/answers.py's, shared with the search gym.

Contents, top to bottom:
- worlds and tasks: make_tasks (each task draws its own random world of facts), answer_text
- MemoryEnv: reset / step, one `search` fact per call, reward = objectives answered exactly
- scripted policies (oracle / any_answer / random) and play(), which drives one with folded context
- the vocabulary of the word tokenizer (memory_texts) and setup (gym.py's contract)

What it deliberately simplifies:
1. Search is an exact key lookup on (entity, relation), not BM25: the query must be exactly
   `entity rel1 rel2` (e.g. `moonfall directed by`). Exact lookup makes the skill "copy the pending
   hop from <mem> into <search>" learnable by a tiny model; ranking would add noise, not skill.
2. Every name is one lower-case word and every relation is two words, so facts are always four
   words (`moonfall directed by ada`) and the tiny whitespace tokenizer needs no sub-words.
3. Questions are noun chains, outermost relation first ("country of birthplace of director of
   moonfall"); several objectives are joined with ` ; ` and answered in the same order.
4. The format is strict: nothing but whitespace may stand outside the tags of a turn. A chat model's
   end-of-turn token is not part of its decoded turn (special tokens are skipped, gym.strip_end_marker).
"""

import random
import re
from dataclasses import dataclass, field, replace

import hf
from gym import build_tokenizer, word_format
from gyms.answers import (TAGS, answer_reward, check_answer_reward, check_turn, extract_answer, extract_mem, extract_tag,
                          score_episode, strip_end_marker)

MODEL = 'any'
KEYS = ('train_tasks', 'max_objectives', 'rl_min_objectives', 'oracle_forget', 'oracle_detour', 'oracle_stuck', 'val_tasks',
        'answer_reward', 'mem_target', 'show_budget', 'complete_bonus', 'hop_reward', 'rl_spare_turns')
TASK_KEYS = ('max_objectives',)  # held-out and validation questions have up to max_objectives + 1 parts

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
BUDGET_WORDS = "turns left"  # show_budget's last line of an observation: 'turns left 3'
BAD_FORMAT = "error : bad format"


@dataclass
class MemoryTask:
    id: str
    question: str            # "country of birthplace of director of moonfall ; founder of acme"
    golds: list              # k alias lists, [["arvenia"], ["bo"]]
    facts: dict              # "moonfall directed by" -> "ada": the whole world of this episode
    hops: list = field(default_factory=list)  # hops per objective
    spare_turns: int = 1     # the env's budget: the oracle's turns (a search per hop, one answer) plus these


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


def needed_entities(task, found):
    """What a folded agent must carry from the facts found so far (list[str]): progress(...)[0]."""
    return progress(task, found)[0]


def progress(task, found):
    """(what a folded agent must carry from the facts found so far: the answer of each objective it
    finished and the farthest entity of the one in progress; how many objectives it finished; how many
    hops of the question's chains it found in order, 0..sum(task.hops)).
    found: {'entity rel1 rel2': [turns whose search returned it]}. Objectives are taken in the question's order, as the oracle takes them: a
    hop counts for an objective only when found after the hop before it (after the previous
    objective's last hop, for its first one), so a fact found earlier for another objective is not
    this one's progress. The root is in the question and never needed."""
    out, last, n_hops = [], -1, 0
    for n_done, q in enumerate(task.question.split(" ; ")):
        words = q.split(" of ")
        e = root = words[-1]
        hops = [NOUN_TO_REL[noun] for noun in reversed(words[:-1])]
        for done, rel in enumerate(hops):
            later = [t for t in found.get(f"{e} {rel}", ()) if t > last]
            if not later:
                break
            e, last = task.facts[f"{e} {rel}"], min(later)
        else:
            done = len(hops)
        n_hops += done
        if e != root:
            out.append(e)
        if done < len(hops):  # this objective is in progress: the ones after it have not started
            return out, n_done, n_hops
    return out, len(task.golds), n_hops


def memory_quality(task, turn_text, found):
    """The fraction of needed_entities(task, found) that one turn's <mem> holds (as words), or None
    when nothing is needed yet (the first turn, or no fact found). found: the facts returned before
    this turn (needed_entities), which is all the turn's memory could have been written from. The lossy set-up's metric: 1.0 is
    a memory a folded agent can finish from, lower values lost something it needs."""
    need = needed_entities(task, found)
    if not need:
        return None
    words = set(re.findall(r"[a-z]+", (extract_mem(turn_text) or "").lower()))
    return sum(e in words for e in need) / len(need)


def make_tasks(split, n, seed=0, n_objectives=None, hops=(2, 3)):
    """n memory tasks of one split, each with its own world.

    split: 'train', 'heldout' or 'val' (different seed streams, so different worlds; 'val' is the
    validation split that recipes are chosen on).
    n_objectives: (lo, hi) inclusive range of sub-questions per task; default (1, 4) for train and
    (1, 5) for heldout and val, which so also test one more objective than training saw. hops: (lo, hi)
    inclusive hops per sub-question.
    Returns list[MemoryTask]; deterministic in (split, n, seed, ranges). Raises ValueError on an
    unknown split.
    """
    if split not in ("train", "heldout", "val"):
        raise ValueError(f"unknown split {split!r}")
    if n_objectives is None:
        # a tiny model does not extrapolate far in question length: after training on k <= 3, the
        # warm-started agent began 58 of 60 held-out k=4 episodes on the wrong objective (both agents
        # see the same first turn). Train up to 4, hold out up to 5: k=5 is the one-more test.
        n_objectives = (1, 4) if split == "train" else (1, 5)  # heldout and val
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


def answer_text(task):
    """The gold answer exactly as the policy writes it: '<answer> a1 ; a2 </answer>'."""
    return "<answer> " + " ; ".join(g[0] for g in task.golds) + " </answer>"

# -----------------------------------------------------------------------------
# environment


class MemoryEnv:
    """One episode of the memory gym (see the env protocol in the repo spec).

    step(action_text): action_text is what the policy wrote after the forced `<mem>` prefix,
    e.g. 'moonfall directed by </mem> <search> moonfall directed by </search>'.
    - well-formed search: observation = the fact sentence ('moonfall directed by ada') or 'no result'
    - well-formed answer: ends the episode; reward = em_count (0..k; answer_reward='all': k only when
      every objective is right, answers.answer_reward), plus complete_bonus when every objective is
      right, plus hop_reward * (hops of the question's chains found in order) / (all its hops), if
      the WHOLE episode passes validate_format, else 0.0 (hop_reward is a process reward: a search
      that follows the question's chain pays even when the answer is then wrong)
    - malformed turn: observation 'error : bad format', counted in n_invalid; the episode goes on
      but its final reward will be 0 (the format check covers every turn). A turn cut at the
      response limit (finish='length') is malformed whatever its text (its text fails the format
      check anyway: a well-formed turn ends with a stop token, </search> or </answer>)
    - own budget: after `budget` turns without an answer (max_turns, else 1 + the question's hops +
      the task's spare_turns: by default one turn more than the oracle needs) the episode ends
      (stop='budget', 0).
    - show_budget: every observation gets a last line 'turns left N', N = the turns left after this
      one, counted to the smaller of the budget and turn_limit (the rollout's max_turns, which can end
      the episode first). Under folding the observation is the only place a policy can read it.
    """

    def __init__(self, max_turns=None, require_think=False, answer_reward='em', show_budget=False, turn_limit=None,
                 complete_bonus=0.0, hop_reward=0.0):
        self.max_turns, self.require_think, self.complete_bonus = max_turns, require_think, complete_bonus
        self.hop_reward = hop_reward
        self.answer_reward = check_answer_reward(answer_reward)
        self.show_budget, self.turn_limit = show_budget, turn_limit

    def reset(self, task):
        """Start an episode; returns the prompt (the question words)."""
        self.task, self.turns, self.n_invalid, self.cut = task, [], 0, []
        self.found, self.quality, self.n_found = {}, [], []  # fact -> turns that returned it; per turn
        self.budget = self.max_turns or 1 + sum(task.hops) + task.spare_turns
        return task.question

    def step(self, action_text, finish="stop"):
        """Returns (obs: str, reward: float, done: bool, info: dict). Never raises on a str.
        finish: 'stop' or 'length' (cut at the response limit: a malformed turn)."""
        text = "<mem> " + strip_end_marker(action_text)
        self.turns.append(text)
        self.quality.append(memory_quality(self.task, text, self.found))
        self.n_found.append(progress(self.task, self.found)[1])  # objectives answered by facts before this turn
        action = check_turn(text, self.require_think)[0] if finish != "length" else None
        if finish == "length":
            self.cut.append(len(self.turns))
        info = dict(n_turns=len(self.turns), n_invalid=self.n_invalid, turn_ok=action is not None)
        if action == "answer":
            return "", *self._finish("answer", extract_answer(text))
        if action == "search":
            query = " ".join(extract_tag(text, "search").split())
            obs = f"{query} {self.task.facts[query]}" if query in self.task.facts else NO_RESULT
            if query in self.task.facts:
                self.found.setdefault(query, []).append(len(self.turns))
        else:
            self.n_invalid += 1
            obs = BAD_FORMAT
        if self.show_budget:
            obs += f"\n{BUDGET_WORDS} {max(0, min(self.budget, self.turn_limit or self.budget) - len(self.turns))}"
        if len(self.turns) >= self.budget:
            return obs, *self._finish("budget", None, turn_ok=action is not None)
        info.update(n_invalid=self.n_invalid, hop_share=self.hop_share())  # an episode the rollout cuts keeps these
        return obs, 0.0, False, info

    def hop_share(self):
        """The share of the question's hops that the searches so far found in order (progress; one hop
        per ' of ' in the question), 0..1."""
        return progress(self.task, self.found)[2] / self.task.question.count(" of ")

    def _finish(self, stop, answer, turn_ok=True):
        s, ok, reason = score_episode(answer, self.task.golds, self.turns, self.require_think, self.cut)
        scored = ok and stop == "answer"
        success = scored and s["em_count"] == s["k"]  # every objective right AND a valid format
        hop_share = self.hop_share()
        reward = (answer_reward(s, self.answer_reward) + self.complete_bonus * success
                  + self.hop_reward * hop_share) if scored else 0.0
        known = [q for q in self.quality if q is not None]
        info = dict(stop=stop, success=success, n_turns=len(self.turns), n_invalid=self.n_invalid,
                    format_ok=ok, format_reason=reason, answer=answer, mem_quality_turns=list(self.quality),
                    answers_found_turns=list(self.n_found), hop_share=hop_share,
                    mem_quality=sum(known) / len(known) if known else None, turn_ok=turn_ok, **s)
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
# instead of by counting segments, which does not extend to more objectives than training showed
# (without it, opening the wrong next objective was the commonest error). make_tasks keeps roots
# distinct within a question.


def _pending_chain(sub_question):
    """'country of birthplace of director of moonfall' -> 'moonfall moonfall directed by born in located in'."""
    words = sub_question.split(" of ")
    return " ".join([words[-1], words[-1]] + [NOUN_TO_REL[w] for w in reversed(words[:-1])])


def _next_objective(objectives, root):
    """The objective after the one whose root is `root`, or None (last one, or no such root)."""
    roots = [q.split()[-1] for q in objectives]
    i = roots.index(root) + 1 if root in roots else len(roots)
    return objectives[i] if i < len(objectives) else None


def oracle_mem(question, mem, obs, forget=False):
    """The oracle's next <mem> content (str) from the folded context. forget: when this turn closes an
    objective that is not the last, keep its slot but not its answer (the lossy oracle)."""
    objectives = question.split(" ; ")
    segs = [s.split() for s in mem.split(";")] if mem else []
    fact = (obs or "").split("\n")[0].split()  # the fact; show_budget's line after it is not part of it
    # fold the last observation into the pending segment: 'root e r1 r2 rest' + fact 'e r1 r2 o' -> 'root o rest'
    if segs and len(segs[-1]) >= 4 and len(fact) == 4 and segs[-1][1:4] == fact[:3]:
        segs[-1] = segs[-1][:1] + [fact[3]] + segs[-1][4:]
    if not segs:
        segs.append(_pending_chain(objectives[0]).split())
    elif len(segs[-1]) == 2:  # 'root answer': objective done, open the next one
        root, segs[-1] = segs[-1][0], segs[-1][1:]
        nxt = _next_objective(objectives, root)
        if nxt is not None:
            segs[-1] = [] if forget else segs[-1]
            segs.append(_pending_chain(nxt).split())
    return " ; ".join(" ".join(s) for s in segs).strip()


def oracle_policy(question, mem, obs, forget=False):
    """Correct mem, next needed hop, answer when every objective is resolved. forget: see oracle_mem;
    a forgotten answer is an empty part of the final answer ('<answer> ; arvenia </answer>')."""
    new = oracle_mem(question, mem, obs, forget)
    segs = [s.split() for s in new.split(";")]
    if all(len(s) <= 1 for s in segs):
        return f"{new} </mem> <answer> {new} </answer>"
    return f"{new} </mem> <search> {' '.join(segs[-1][1:4])} </search>"


def make_lossy_oracle(rng, p):
    """The lossy set-up's warm-start policy: the oracle, except that each objective it closes before the last
    is forgotten with probability p (its <mem> keeps an empty slot, its answer an empty part). It
    still teaches the format, the searches and answering, but carrying answers only part of the time:
    a folded agent must learn from RL to keep them; a full-history agent can read them back from its
    history. rng: draws one seed, so the caller's stream moves by one draw per episode."""
    own = random.Random(rng.random())
    return lambda question, mem, obs: oracle_policy(question, mem, obs, forget=own.random() < p)


def with_detour(rng, p, policy, stuck=False):
    """The warm start's recovery lesson: with probability p the episode makes one wrong search (the
    pending entity with another relation, at one of its searches drawn at random), which returns
    'no result' or an unrelated fact; the next turn, policy's own, searches right. The wrong turn is
    returned as (text, False): rollout plays it and trains on none of its tokens, so the warm start
    imitates the recovery, never the mistake. The gym's budget (one turn more than the oracle needs)
    leaves room for exactly one. rng: draws one seed, as make_lossy_oracle.
    stuck=True, the last-turn lesson instead: the wrong search is repeated (untrained) until the
    observation says one turn is left (show_budget's 'turns left 1'), and that turn answers what the
    notes hold (trained; _answer_from_notes). The policy
    being trained repeats a failed search until the budget ends; the oracle alone never shows a last turn."""
    own, state = random.Random(rng.random()), dict(searches=0, at=None, wrong=None)

    def act(question, mem, obs):
        if state['at'] is None:  # first turn: one of the episode's searches (one per hop), or none
            n_searches = sum(len(q.split(" of ")) - 1 for q in question.split(" ; "))
            state['at'] = own.randrange(n_searches) if own.random() < p else -1
        if state['wrong'] is not None:  # stuck on the wrong search: answer on the last turn
            if _turns_left(obs) == 1:
                return f"{mem} </mem> <answer> {_answer_from_notes(question, mem)} </answer>"
            return f"{mem} </mem> <search> {state['wrong']} </search>", False
        text = policy(question, mem, obs)
        if "<search>" not in text:
            return text
        i, state['searches'] = state['searches'], state['searches'] + 1
        if i != state['at']:
            return text
        query = extract_tag("<mem> " + text, "search").split()
        wrong = f"{query[0]} {own.choice([r for r in RELATIONS if r != ' '.join(query[1:])])}"
        state['wrong'] = wrong if stuck else None
        return text.replace(f"<search> {' '.join(query)} </search>", f"<search> {wrong} </search>"), False
    return act


def _turns_left(obs):
    """show_budget's count on the observation's last line ('turns left 3' -> 3), or None without one."""
    last = (obs or "").split("\n")[-1].split()
    return int(last[-1]) if " ".join(last[:-1]) == BUDGET_WORDS and last[-1].isdigit() else None


def _answer_from_notes(question, mem):
    """Every objective's answer as far as the notes reached it: a resolved one's answer, a pending chain's
    current entity, else (a forgotten slot, one not opened) its root: 'castor ; acme dag married to' on
    a three-part question -> 'castor ; dag ; <root of the third>'. Never an empty part, so always a valid answer."""
    segs = [s.split() for s in mem.split(";")]
    roots = [q.split()[-1] for q in question.split(" ; ")]
    return " ; ".join(segs[i][min(1, len(segs[i]) - 1)] if i < len(segs) and segs[i] else root
                      for i, root in enumerate(roots))


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
        action = action[0] if isinstance(action, tuple) else action  # with_detour's (text, False)
        obs, reward, done, info = env.step(action)
        turns.append(action)
        observations.append(obs)
        mem = extract_mem("<mem> " + action)
        if done:
            return turns, observations, reward, info

# -----------------------------------------------------------------------------
# vocabulary


def memory_texts(max_turns=0):
    """Texts covering every word the gym can emit or the oracle can write (names, relation words
    and nouns, 'of', ';', messages, tags): build the word tokenizer's vocabulary from their words.
    max_turns > 0 (show_budget): also 'turns left' and the numbers 0..max_turns."""
    texts = [" ".join(p) for p in POOLS.values()]
    texts += list(RELATIONS) + [" ".join(NOUN_TO_REL), "of ;", NO_RESULT, BAD_FORMAT]
    texts += [" ".join(f"<{t}> </{t}>" for t in TAGS)]
    if max_turns:
        texts += [BUDGET_WORDS + " " + " ".join(map(str, range(max_turns + 1)))]
    return texts


# -----------------------------------------------------------------------------
# the gym contract (gym.py)


# A chat model is told the format once, in the system turn, kept short: a folded context re-reads it
# every turn. The question is the user turn and each observation a tool result.
SYSTEM_PROMPT = ("Look up one fact per turn, then answer. A turn is\n"
                 "<mem> notes </mem> <search> entity relation </search>\n"
                 "or <mem> notes </mem> <answer> answer1 ; answer2 </answer>")


def folded_policy(policy):
    """Adapt a memory policy (question, last mem, last obs) -> text to rollout's (episode) -> text."""
    def act(ep):
        mem = extract_mem("<mem> " + ep.actions[-1]) if ep.actions else None
        return policy(ep.task.question, mem, ep.texts[-1] if ep.actions else None)
    return act


def setup(cfg, vocab=None):
    """train_tasks (0: 2000) and eval_tasks (0: 96) tasks drawn with cfg's seed, training questions
    with 1..max_objectives parts and held-out ones with up to one more, and val_tasks validation tasks
    like the held-out ones (0: none; train.py evaluates them after held-out); the warm start imitates the
    oracle through the folded context on every training task, while RL draws only those with at least
    rl_min_objectives parts (rl_tasks), whose budget has rl_spare_turns turns beyond the oracle's (held-out,
    validation and the scripted episodes keep one). model tiny: a word vocabulary built from the gym's texts (or
    the checkpoint's `vocab`); any other model: its tokenizer and chat template (hf.chat_format, which
    raises ValueError naming what the model lacks)."""
    check_answer_reward(cfg["answer_reward"])
    k = cfg["max_objectives"]
    if k < 1:
        raise ValueError(f"config key 'max_objectives' must be >= 1, got {k}")
    if not 1 <= cfg["rl_min_objectives"] <= k:
        raise ValueError(f"config key 'rl_min_objectives' must be 1..max_objectives ({k}), got {cfg['rl_min_objectives']}")
    train_tasks = make_tasks("train", cfg["train_tasks"] or 2000, seed=cfg["seed"], n_objectives=(1, k))
    rl_tasks = [replace(t, spare_turns=cfg["rl_spare_turns"]) for t in train_tasks if len(t.golds) >= cfg["rl_min_objectives"]]
    if not rl_tasks:
        raise ValueError(f"no training task has {cfg['rl_min_objectives']}+ parts (rl_min_objectives) among "
                         f"{len(train_tasks)}: lower it or raise train_tasks")
    eval_tasks = make_tasks("heldout", cfg["eval_tasks"] or 96, seed=cfg["seed"], n_objectives=(1, k + 1))
    val_tasks = make_tasks("val", cfg["val_tasks"], seed=cfg["seed"], n_objectives=(1, k + 1))
    if cfg["model"] == "tiny":
        tok = build_tokenizer(memory_texts(cfg["max_turns"] if cfg["show_budget"] else 0), vocab)
        fmt = word_format(tok, memory=True)
    else:
        tok = hf.load_tokenizer(cfg["model"], cfg["gguf_file"], cfg["chat_template"])
        # enable_thinking: no empty think block written into every turn (a <think> is optional here)
        fmt = hf.chat_format(tok, system=SYSTEM_PROMPT, enable_thinking=True, memory=True)
    p, detour, stuck = cfg["oracle_forget"], cfg["oracle_detour"], cfg["oracle_stuck"]
    if stuck and detour:
        raise ValueError("config keys 'oracle_detour' and 'oracle_stuck' are each one wrong search an episode: set one of them")
    if stuck and not cfg["show_budget"]:
        raise ValueError("config key 'oracle_stuck' needs show_budget: true (its episodes answer when the observation "
                         "says one turn is left)")

    def warm(rng):
        policy = make_lossy_oracle(rng, p) if p else oracle_policy
        return folded_policy(with_detour(rng, detour or stuck, policy, stuck=bool(stuck)) if detour or stuck else policy)
    return dict(tok=tok, fmt=fmt, train_tasks=train_tasks, rl_tasks=rl_tasks, eval_tasks=eval_tasks,
                val_tasks=val_tasks,
                make_env=lambda: MemoryEnv(answer_reward=cfg["answer_reward"], show_budget=cfg["show_budget"],
                                           turn_limit=cfg["max_turns"], complete_bonus=cfg["complete_bonus"],
                                           hop_reward=cfg["hop_reward"]),
                warm_policy=warm, baselines={}, answer_text=answer_text)
