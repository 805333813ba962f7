"""
SearchQA: MemPO's gym for real models. Multi-hop questions (HotpotQA dev sample, Bamboogle), a
`search` tool that is BM25 (bm25s) over a paragraph corpus, answers scored by EM/F1.

Each turn the policy writes
    <mem>summary</mem><think>reasoning</think><search>one query</search>
or  <mem>summary</mem><think>reasoning</think><answer>a1; a2</answer>
The rollout forces the `<mem>` prefix (hf.prompt_ids / hf.tool_turn_ids prefix='<mem>'), so
env.step receives the text AFTER it. The observation step() returns is plain text (the top-k
passages); the chat template wraps it in <tool_response> when the rollout renders it as a tool
message (hf.tool_turn_ids). Format checking and answer scoring are gym.py's.

Warm start: oracle_policy, a scripted turn per supporting title (its search, a one-line note per
title found in <mem>), then the gold answer; it sees only what MemPO folding keeps. HotpotQA only:
Bamboogle has no supporting titles and is evaluation-only.

Data: data/hotpotqa_dev_sample.jsonl (500 questions with their 10 paragraphs) and
data/bamboogle.jsonl (125 questions, no paragraphs). The default corpus is every paragraph of the
HotpotQA sample ("title: text", 4,943 distinct); any JSONL of {title, text} rows works too.
"""

import hashlib
import os
import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import hf
from gym import read_jsonl
from gyms.answers import answer_reward, check_answer_reward, score_episode, strip_end_marker, validate_format

MODEL = 'hf'
KEYS = ('data', 'prompt_style', 'max_obs_tokens', 'train_tasks', 'require_think', 'enable_thinking', 'answer_reward')
TASK_KEYS = ('data',)  # both splits come from the data file

DATA = Path(__file__).resolve().parent.parent / 'data'
SOURCES = {'hotpotqa': DATA / 'hotpotqa_dev_sample.jsonl', 'bamboogle': DATA / 'bamboogle.jsonl'}
DEFAULT_CORPUS = SOURCES['hotpotqa']
NO_RESULT = 'no results for this query'

# -----------------------------------------------------------------------------
# prompts

# MemPO trains on the bare question (the format is learnt from the reward and the forced <mem>
# prefix) and evaluates with explicit instructions; this is our wording of those instructions.
EVAL_PROMPT = """Answer the question below by searching a collection of documents, one step at a time.

Every turn has two parts:
1. Inside <mem> </mem>, keep a short summary of what you have found so far and what is still missing. Then reason about the next step inside <think> </think>.
2. Then do exactly one of these:
   - <search> query </search>: one query about one missing fact. The results come back in the next message.
   - <answer> answer </answer>: the final answer as a short phrase, no explanation. If the question asks for several things, put all the answers in this one block, in the order asked, separated by semicolons.

Rules:
- A turn is <mem>...</mem> <think>...</think> followed by <search>...</search> or <answer>...</answer>, with nothing outside these tags.
- Never put more than one query or question into a search.
- Search at least once before you answer.

Question: {question}"""


def make_prompt(question, style='train'):
    """The first user message: style 'train' is the bare question (MemPO's minimal training prompt),
    'eval' wraps it in EVAL_PROMPT. Raises ValueError for another style."""
    if style == 'train':
        return question
    if style == 'eval':
        return EVAL_PROMPT.format(question=question)
    raise ValueError(f"config key 'prompt_style' must be 'train' or 'eval', got {style!r}")

# -----------------------------------------------------------------------------
# questions


@dataclass
class SearchTask:
    id: str
    question: str               # several objectives are joined by ' ; '
    golds: list                 # one alias list per objective: [["Chief of Protocol"]]
    supporting_titles: list = field(default_factory=list)


def load_jsonl_questions(path):
    """Questions from a JSONL file of {id?, question, answers: [str, ...], supporting_titles?}.

    Returns list[SearchTask] in file order, one objective per question (golds = [answers]); an id
    defaults to '<file stem>-<line>'. Raises FileNotFoundError for a missing file, ValueError
    naming file:line for malformed JSON, a missing/empty question, or a question without a
    non-empty answer, and ValueError for a file without questions.
    """
    tasks = []
    for n, row in read_jsonl(path):
        q, answers = row.get('question'), row.get('answers')
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f'{path}:{n}: no question')
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not any(isinstance(a, str) and a.strip() for a in answers):
            raise ValueError(f'{path}:{n}: question has no answers')
        answers = [a for a in answers if isinstance(a, str) and a.strip()]
        tasks.append(SearchTask(str(row.get('id', f'{Path(path).stem}-{n}')), q.strip(), [answers],
                                list(row.get('supporting_titles', []))))
    if not tasks:
        raise ValueError(f'{path}: no questions')
    return tasks


def _stable_hash(s):
    return int(hashlib.md5(s.encode()).hexdigest()[:8], 16)


def split_tasks(tasks, split, heldout_frac=0.2):
    """The 'train' or 'heldout' part of tasks. Membership depends only on each task's id (a hash),
    so it is the same across runs, seeds and file order. Raises ValueError for an unknown split."""
    if split not in ('train', 'heldout'):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    cut = int(heldout_frac * 1000)
    return [t for t in tasks if (_stable_hash(t.id) % 1000 < cut) == (split == 'heldout')]


def make_tasks(split, seed=0, source='hotpotqa', heldout_frac=0.2, n_objectives=1):
    """Tasks of one split, shuffled by seed.

    source: 'hotpotqa', 'bamboogle' or a JSONL path. heldout_frac: share of questions held out
    (Bamboogle is an evaluation set: use heldout_frac=1.0 and split='heldout').
    n_objectives > 1 joins that many questions into one multi-objective task ('q1 ; q2',
    answered 'a1; a2'), as MemPO's multi-objective training does.
    Raises ValueError when the split is empty, FileNotFoundError listing the named sets when source is
    neither a name nor a file (or anything load_jsonl_questions raises).
    """
    path = SOURCES.get(source, source)
    if source not in SOURCES and not Path(path).is_file():
        raise FileNotFoundError(f"data {source!r}: no such file, and not a named set ({', '.join(SOURCES)})")
    tasks = split_tasks(load_jsonl_questions(path), split, heldout_frac)
    if not tasks:
        raise ValueError(f'{path}: split {split!r} is empty (heldout_frac={heldout_frac})')
    random.Random(seed).shuffle(tasks)
    if n_objectives > 1:
        groups = [tasks[i:i + n_objectives] for i in range(0, len(tasks) - n_objectives + 1, n_objectives)]
        tasks = [SearchTask('+'.join(t.id for t in g), ' ; '.join(t.question for t in g),
                            [t.golds[0] for t in g], sum((t.supporting_titles for t in g), [])) for g in groups]
    return tasks

# -----------------------------------------------------------------------------
# BM25 search

_INDEXES = {}   # (resolved corpus path, mtime) -> SearchIndex: built once per corpus and process


def load_corpus(path=DEFAULT_CORPUS):
    """Distinct passages 'title: text' from a JSONL of HotpotQA rows (all their `paragraphs`) or of
    {title, text} rows, in first-seen order. Raises as gym.read_jsonl, or ValueError for a row with
    neither form or a file without passages."""
    docs, seen = [], set()
    for n, row in read_jsonl(path):
        paras = row['paragraphs'] if isinstance(row.get('paragraphs'), list) else [row]
        for p in paras:
            if not isinstance(p, dict) or not isinstance(p.get('text'), str):
                raise ValueError(f'{path}:{n}: expected {{title, text}} or HotpotQA paragraphs')
            doc = f"{p.get('title', '')}: {p['text']}" if p.get('title') else p['text']
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
    if not docs:
        raise ValueError(f'{path}: no passages')
    return docs


class SearchIndex:
    """BM25 (bm25s, Lucene variant, English stop words, no stemming) over a list of passages."""

    def __init__(self, docs):
        import bm25s
        self.docs = docs
        self.bm25 = bm25s.BM25()
        self.bm25.index(self._tokenize(docs), show_progress=False)

    @staticmethod
    def _tokenize(texts):
        """Words of each text, passages and queries alike: NFKC, case-folded, every run of word
        characters. Unlike bm25s's default pattern (\\w\\w+) one-character words count ('Malcolm X',
        'Plan 9'); bm25s's English stop words are dropped except 'a' ('Vitamin A')."""
        import bm25s
        from bm25s.stopwords import STOPWORDS_EN
        texts = [unicodedata.normalize('NFKC', t).casefold() for t in texts]
        stop = [w for w in STOPWORDS_EN if len(w) > 1]
        return bm25s.tokenize(texts, lower=False, token_pattern=r'(?u)\b\w+\b', stopwords=stop,
                              return_ids=False, show_progress=False)

    def search(self, query, k=3):
        """Top-k passages for query, best first, as [(passage, score)]; [] when no query word
        is in the corpus vocabulary (or the query is only stop words)."""
        toks = self._tokenize([query])[0]
        if not toks:
            return []
        k = min(k, len(self.docs))
        idx, scores = self.bm25.retrieve([toks], k=k, show_progress=False)
        return [(self.docs[int(i)], float(s)) for i, s in zip(idx[0], scores[0]) if s > 0]


def get_index(corpus=DEFAULT_CORPUS):
    """The SearchIndex of a corpus file, built at first use and cached by (path, mtime)."""
    path = Path(corpus).resolve()
    key = (str(path), path.stat().st_mtime if path.exists() else None)
    if key not in _INDEXES:
        _INDEXES[key] = SearchIndex(load_corpus(path))
    return _INDEXES[key]


def truncate(text, max_tokens, tokenizer=None):
    """Cut text to at most max_tokens tokens of tokenizer (an HF tokenizer), or max_tokens
    whitespace-separated words when tokenizer is None. Cuts at a token's character boundary, so
    no partial character is produced; returns text unchanged when it fits. Special-token strings in the
    text count as the pieces the observation is encoded into (hf.py: split_special_tokens=True)."""
    if tokenizer is None:
        ends = [m.end() for m in re.finditer(r'\S+', text)]
        return text if len(ends) <= max_tokens else text[:ends[max_tokens - 1]] if max_tokens > 0 else ''
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                        split_special_tokens=True)['offset_mapping']
    if len(offsets) <= max_tokens:
        return text
    return text[:offsets[max_tokens - 1][1]] if max_tokens > 0 else ''


def format_results(hits):
    """'[1] title: text' lines, one per hit, or NO_RESULT."""
    return '\n'.join(f'[{i}] {doc}' for i, (doc, _) in enumerate(hits, 1)) if hits else NO_RESULT

# -----------------------------------------------------------------------------
# environment


def _action(text, require_think):
    """'answer', 'search' or None for one full turn text, with answers.validate_format's rules: a valid answer
    turn passes validate_format alone; a valid search turn passes when an answer turn follows."""
    if validate_format([text], require_think)[0]:
        return 'answer'
    if validate_format([text, '<mem>x</mem><think>x</think><answer>x</answer>'], require_think)[0]:
        return 'search'
    return None


def _tag(text, tag):
    m = re.search(rf'<{tag}>(.*?)</{tag}>', text, flags=re.S)
    return m.group(1).strip() if m else ''


class SearchQAEnv:
    """One SearchQA episode (see the env protocol in the repo spec).

    reset(task) -> the first user message (make_prompt(task.question, prompt_style)).
    step(action_text): the policy's decoded turn after the forced prefix (a trailing <|im_end|> or
    <|endoftext|> is dropped). Returns (obs: str, reward: float, done: bool, info: dict):
    - a well-formed search turn: obs = top_k BM25 passages ('[1] title: text', ...), cut to
      max_obs_tokens tokens of `tokenizer` (words if None); plain text, not yet <tool_response>.
    - a well-formed answer turn ends the episode: reward = number of objectives answered exactly
      (EM after normalisation; other answer_reward: answers.answer_reward), when
      the whole episode passes validate_format and, with require_search, searched at least once;
      else 0. info has em, f1, em_count, k, format_ok, format_reason, answer, n_search,
      stop='answer', success (all objectives exactly right, whichever the reward).
    - a malformed turn: an error observation, counted in n_invalid, uses a turn; the final reward
      will be 0 since the whole episode fails the format check. A turn cut at the response limit
      (finish='length') is malformed whatever its text: its search is not run, its answer not taken.
    - max_turns turns without an answer: done, reward 0, stop='budget'.
    Never raises on a str action.
    """

    def __init__(self, tokenizer=None, corpus=DEFAULT_CORPUS, top_k=3, max_obs_tokens=400, max_turns=6,
                 require_think=True, require_search=True, forced_prefix='<mem>', prompt_style='train', answer_reward='em'):
        self.answer_reward = check_answer_reward(answer_reward)
        self.tokenizer, self.top_k, self.max_obs_tokens = tokenizer, top_k, max_obs_tokens
        self.max_turns, self.require_think, self.require_search = max_turns, require_think, require_search
        self.forced_prefix, self.prompt_style = forced_prefix, prompt_style
        self.index = get_index(corpus)
        make_prompt('', prompt_style)   # fail at construction on a bad style

    def reset(self, task):
        self.task, self.turns, self.n_invalid, self.n_search, self.cut = task, [], 0, 0, []
        return make_prompt(task.question, self.prompt_style)

    def search(self, query):
        """The observation text for one query."""
        obs = format_results(self.index.search(query, self.top_k))
        return truncate(obs, self.max_obs_tokens, self.tokenizer)

    def step(self, action_text, finish='stop'):
        """finish: 'stop' or 'length' (cut at the response limit, e.g. after </search> but before
        <|im_end|>: a malformed turn)."""
        text = self.forced_prefix + strip_end_marker(action_text)
        self.turns.append(text)
        action = _action(text, self.require_think) if finish != 'length' else None
        if finish == 'length':
            self.cut.append(len(self.turns))
        if action == 'answer':
            return '', *self._finish('answer', _tag(text, 'answer'))
        if action == 'search':
            self.n_search += 1
            obs = self.search(_tag(text, 'search'))
        else:
            self.n_invalid += 1
            reason = validate_format([text], self.require_think)[1] if finish != 'length' else \
                'the turn reached the response length limit before it ended'
            obs = (f'error: bad format ({reason}). Write <mem>...</mem><think>...</think> and then '
                   '<search>query</search> or <answer>answer</answer>.')
        if len(self.turns) >= self.max_turns:
            return obs, *self._finish('budget', None, turn_ok=action is not None)
        return obs, 0.0, False, dict(n_turns=len(self.turns), n_invalid=self.n_invalid, n_search=self.n_search,
                                     turn_ok=action is not None)

    def _finish(self, stop, answer, turn_ok=True):
        s, ok, reason = score_episode(answer, self.task.golds, self.turns, self.require_think, self.cut)
        if ok and self.require_search and self.n_search == 0:
            ok, reason = False, 'answered without searching'
        scored = ok and stop == 'answer'
        reward = answer_reward(s, self.answer_reward) if scored else 0.0
        info = dict(stop=stop, success=scored and s['em_count'] == s['k'], n_turns=len(self.turns), n_invalid=self.n_invalid,
                    n_search=self.n_search, format_ok=ok, format_reason=reason, answer=answer, turn_ok=turn_ok, **s)
        return reward, True, info

# -----------------------------------------------------------------------------
# the scripted oracle (the warm start)
#
# Turn i searches for supporting title i with the title itself as the query (BM25 ranks that title's
# passage in the top 3 for nearly every supporting title; docs/RESULTS.md). Its <mem> is the state:
# one line 'title: snippet' (or 'title: not found') per title searched so far, so the next title is
# the one after as many lines. The snippet is SNIPPET_WORDS words of the found passage's first
# sentence that names a gold answer or another supporting title (the bridge), taken around that
# name, else of its first sentence. After the last title it answers with the gold (answer_text).

NOTHING = 'nothing found yet'   # the first turn's <mem>
SNIPPET_WORDS = 20


def _bare(title):
    """'Kiss and Tell (1945 film)' -> 'Kiss and Tell'."""
    return re.sub(r'\s*\([^)]*\)$', '', title)


def found_note(task, title, obs):
    """The <mem> line for one searched title: 'title: snippet' from that title's passage in the
    observation obs, or 'title: not found'."""
    m = re.search(rf'^\[\d+\] {re.escape(title)}: (.+)$', obs, flags=re.M)
    if not m:
        return f'{title}: not found'
    keys = [a.lower() for g in task.golds for a in g] + [_bare(t).lower() for t in task.supporting_titles if t != title]
    sentences = re.split(r'(?<=[.!?])\s+', m.group(1))
    s, at = next(((s, s.lower().find(k)) for s in sentences for k in keys if k in s.lower()), (sentences[0], 0))
    start = max(0, len(s[:at].split()) - SNIPPET_WORDS // 2)  # the key stays in a long sentence's cut
    return f"{title}: {' '.join(s.split()[start:start + SNIPPET_WORDS])}"


def oracle_turn(task, mem, obs):
    """The oracle's turn text after the forced '<mem>' prefix, from its last <mem> content and the
    last observation (both None at the first turn): a search for the next supporting title, or the
    gold answer once every title was searched."""
    notes = [] if mem in (None, NOTHING) else mem.splitlines()
    if mem is not None and len(notes) < len(task.supporting_titles):  # else its answer turn was cut: again
        notes.append(found_note(task, task.supporting_titles[len(notes)], obs))
    head = '\n'.join(notes) or NOTHING
    if len(notes) < len(task.supporting_titles):
        title = task.supporting_titles[len(notes)]
        return f'{head}\n</mem>\n<think>\nNext I need {title}.\n</think>\n<search>{title}</search>'
    return f'{head}\n</mem>\n<think>\nI have found what I need.\n</think>\n{answer_text(task)}'


def oracle_policy(ep):
    """rollout's scripted policy (episode -> turn text) on what MemPO folding keeps: the task, its own
    last <mem> (from ep.actions[-1]) and the last observation."""
    if not ep.actions:
        return oracle_turn(ep.task, None, None)
    return oracle_turn(ep.task, _tag('<mem>' + ep.actions[-1], 'mem'), ep.texts[-1])

# -----------------------------------------------------------------------------
# the gym contract (gym.py)


def answer_text(task):
    """The gold answer as the policy writes it: '<answer>a1; a2</answer>'."""
    return '<answer>' + '; '.join(g[0] for g in task.golds) + '</answer>'


def setup(cfg, vocab=None):
    """Questions of cfg['data'] (default hotpotqa), split by id hash: the first train_tasks and
    eval_tasks of each split (0 = all); the policy's own tokenizer and chat template. The warm start
    imitates oracle_policy when every training task has supporting titles (HotpotQA), else None."""
    check_answer_reward(cfg['answer_reward'])  # before the data and the index: a typo costs nothing
    make_prompt('', cfg['prompt_style'])  # likewise: a bad style raises here, not at the first episode
    train_tasks = make_tasks('train', cfg['seed'], source=cfg['data'] or 'hotpotqa')  # bad data fails here, first
    eval_tasks = make_tasks('heldout', cfg['seed'], source=cfg['data'] or 'hotpotqa')
    tok = hf.load_tokenizer(cfg['model'], cfg['gguf_file'], cfg['chat_template'])
    stable, detail = hf.check_prefix_stability(tok, enable_thinking=cfg['enable_thinking'])
    if not stable and os.environ.get('RANK', '0') == '0':  # we never re-render: every turn trains in the context it was sampled in
        print(f'note: the chat template rewrites history ({detail}); contexts are kept per turn as sampled')
    n_train, n_eval = cfg['train_tasks'] or len(train_tasks), cfg['eval_tasks'] or len(eval_tasks)
    return dict(tok=tok, fmt=hf.chat_format(tok, enable_thinking=cfg['enable_thinking'], memory=True),
                train_tasks=train_tasks[:n_train], eval_tasks=eval_tasks[:n_eval],
                make_env=lambda: SearchQAEnv(tok, max_turns=cfg['max_turns'], max_obs_tokens=cfg['max_obs_tokens'],
                                             require_think=cfg['enable_thinking'] or cfg['require_think'],
                                             prompt_style=cfg['prompt_style'], answer_reward=cfg['answer_reward']),
                baselines={}, answer_text=answer_text,
                warm_policy=(lambda rng: oracle_policy) if all(t.supporting_titles for t in train_tasks) else None)
