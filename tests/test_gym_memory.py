import importlib.util
import os
import random
import unicodedata
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

import gym
from gyms import answers
from gyms import memory as g

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
# scoring


def test_normalize_answer_unicode_punctuation_articles():
    assert answers.normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert answers.normalize_answer("1990\u20131995") == answers.normalize_answer("1990-1995") == "19901995"  # en dash
    assert answers.normalize_answer("\u201cAn Apple\u201d") == "apple"  # curly quotes, article
    assert answers.normalize_answer("ＡＢＣ") == "abc"  # full-width (NFKC)


def test_em_composed_and_decomposed_accents_match():
    composed, decomposed = "Beyonc\u00e9", "Beyonce\u0301"
    assert composed != decomposed and unicodedata.normalize("NFC", decomposed) == composed
    assert answers.em(decomposed, [composed]) == 1.0
    assert answers.em("beyonce", [composed]) == 0.0  # accents are kept, not stripped


def test_em_f1_hand_computed():
    assert answers.em("the Oslo", ["oslo"]) == 1.0
    assert answers.em("oslo city", ["oslo", "bergen"]) == 0.0
    assert answers.f1("oslo city", ["oslo"]) == 2 * (1 / 2 * 1) / (1 / 2 + 1)  # p=1/2 r=1 -> 2/3
    assert answers.f1("new york city", ["bergen", "york city"]) == 2 * (2 / 3) * 1 / (2 / 3 + 1)  # max over aliases -> 0.8
    assert answers.f1("x", "x") == 1.0  # a bare str gold is one alias


def test_empty_answer_never_matches():
    for pred in ["", "   ", "!!", "\u2013", ". , ;"]:
        assert answers.em(pred, ["", "!", pred]) == 0.0
        assert answers.f1(pred, ["", "!", pred]) == 0.0
    assert answers.score_answers(" ; ", [[""], ["?"]])["em_count"] == 0


def test_article_only_answers_keep_their_text():
    # dropping the articles emptied these, so they could never score
    assert (answers.em("A", "A"), answers.f1("A", "A"), answers.em("a.", "A")) == (1.0, 1.0, 1.0)
    assert answers.normalize_answer("The") == "the" and answers.em("the", "a") == 0.0
    assert answers.em("the Beatles", "Beatles") == 1.0  # articles beside other words are still dropped


def test_case_folding_not_lower_casing():
    # str.lower keeps "ß"
    assert answers.em("STRASSE", "Stra\u00dfe") == 1.0 and answers.em("WEISS", "wei\u00df") == 1.0
    assert answers.em("\u00c9cole", "e\u0301cole") == 1.0  # NFKC composes the accent first


def test_numbers_keep_their_identity():
    # SQuAD's normaliser deletes "." and "-", so 10.8 == 108 and -5 == 5
    for pred, gold, em, f1 in [("108", "10.8", 0, 0), ("195 m", "1.95 m", 0, 0.5),
                               ("$105 million", "$10.5 million", 0, 0.5), ("3.14", "314", 0, 0),
                               ("5", "-5", 0, 0), ("\u22125", "-5", 1, 1), ("\u20135", "-5", 1, 1),
                               ("9984", "9,984", 1, 1), ("1,000,000.5", "1000000.5", 1, 1), (".5", "5", 0, 0)]:
        assert (answers.em(pred, gold), answers.f1(pred, gold)) == (em, f1), (pred, gold)
    # everything else is still SQuAD's: punctuation at word ends, articles, a sentence-final period
    assert answers.em("Paris.", "paris") == answers.em("(-5)", "-5") == answers.em("5.", "5") == 1.0
    assert answers.em("It is 5.", "5") == 0.0 and answers.f1("It is 5.", "5") == 0.5
    assert answers.normalize_answer("COVID-19, 1990\u20131995") == "covid19 19901995"  # a dash after a word is no sign


def test_score_answers_multi_objective():
    golds = [["oslo"], ["ada", "ada lovelace"], ["moonfall"]]
    s = answers.score_answers("Oslo ; Ada Lovelace ; ironbay", golds)
    assert s["em_count"] == 2 and s["k"] == 3 and abs(s["em"] - 2 / 3) < 1e-12
    assert abs(s["f1"] - 2 / 3) < 1e-12
    s = answers.score_answers("oslo", golds)  # missing parts score 0
    assert s["em_count"] == 1 and abs(s["em"] - 1 / 3) < 1e-12
    s = answers.score_answers("bergen ; oslo ; ada ; moonfall", golds)  # position-aligned: no hedging
    assert s["em_count"] == 0
    s = answers.score_answers("new york", [["new york city"], ["paris"]])
    assert s["em_count"] == 0 and abs(s["f1"] - (0.8 / 2)) < 1e-12
    assert answers.score_answers("oslo", ["oslo", "christiania"])["em_count"] == 1  # flat list = one objective


def test_score_answers_uses_the_same_normaliser():
    s = answers.score_answers("A ; STRASSE ; \u22125 ; 10.8", [["a"], ["stra\u00dfe"], ["-5"], ["108"]])
    assert s["em_count"] == 3 and s["f1"] == 0.75

# -----------------------------------------------------------------------------
# format

S = "<mem> ada </mem> <search> ada born in </search>"
A = "<mem> oslo </mem> <answer> oslo </answer>"


def test_valid_episodes_pass():
    assert answers.validate_format([A]) == (True, "ok")
    assert answers.validate_format([S, S, A]) == (True, "ok")
    assert answers.validate_format(["<mem>a</mem><think>b</think><answer>c</answer>"], require_think=True)[0]
    assert answers.validate_format(["\n<mem>\nx\n</mem>\n<think>y</think>\n<search>q</search>\n", A])[0]


def test_invalid_formats_fail():
    bad = {
        "duplicated": ["<mem> a </mem> <mem> b </mem> <answer> c </answer>"],
        "two actions": ["<mem> a </mem> <search> q </search> <answer> c </answer>"],
        "nested": ["<mem> a <search> q </search> </mem> <answer> c </answer>"],
        "nested same": ["<mem> a <mem> b </mem> </mem> <answer> c </answer>"],
        "empty mem": ["<mem> </mem> <answer> c </answer>"],
        "empty answer": ["<mem> a </mem> <answer>  </answer>"],
        "missing mem": ["<answer> c </answer>"],
        "missing action": ["<mem> a </mem>"],
        "unclosed": ["<mem> a </mem> <answer> c"],
        "unbalanced": ["<mem> a </mem> </answer> c </answer>"],
        "mismatched": ["<mem> a </search> <answer> c </answer>"],
        "text outside": ["<mem> a </mem> hello <answer> c </answer>"],
        "trailing text": ["<mem> a </mem> <answer> c </answer> bye"],
        "think after action": ["<mem> a </mem> <answer> c </answer> <think> t </think>"],
        "answer not last": [A, S],
        "two answers": [S, A, A],
        "no answer": [S, S],
        "no turns": [],
    }
    for name, turns in bad.items():
        ok, reason = answers.validate_format(turns)
        assert not ok and reason != "ok", name
    assert not answers.validate_format([A], require_think=True)[0]


def test_extract_answer_from_own_turn_only():
    assert answers.extract_answer("<mem> x </mem> <answer> oslo ; ada </answer>") == "oslo ; ada"
    assert answers.extract_answer("<answer> a </answer> <answer> b </answer>") is None
    assert answers.extract_answer("<mem> x </mem> <search> q </search>") is None
    assert answers.extract_answer("<answer> a <answer> b </answer>") is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(list("<>/ ab;\n\u2013\u00e9") + [f"<{t}>" for t in answers.TAGS] + [f"</{t}>" for t in answers.TAGS]),
                         max_size=30).map("".join) | st.text(max_size=60), max_size=4))
def test_arbitrary_text_never_raises(texts):
    assert isinstance(answers.validate_format(texts)[0], bool)
    assert isinstance(answers.validate_format(texts, require_think=True)[0], bool)
    for t in texts:
        answers.extract_answer(t), answers.extract_mem(t), answers.normalize_answer(t)
        assert 0.0 <= answers.f1(t, [t, "x"]) <= 1.0
        assert 0 <= answers.score_answers(t, [["a"], [t]])["em_count"] <= 2
    env = g.MemoryEnv()
    env.reset(g.make_tasks("train", 1)[0])
    for t in texts:
        obs, r, done, info = env.step(t)
        assert isinstance(obs, str) and r >= 0.0
        if done:
            break


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<mem>", "</mem>", "<search>", "</search>", "<answer>", "</answer>",
                                 "<think>", "</think>", "x", " "]), max_size=14))
def test_tag_soup_valid_iff_structure(words):
    # a single turn valid under the rules must look like mem [think] action; check the converse too
    text = " ".join(words)
    ok, _ = answers.validate_format([text])
    if ok:
        s = text.split()
        assert s[0] == "<mem>" and s[-1] == "</answer>" and s.count("<answer>") == 1

# -----------------------------------------------------------------------------
# tasks and env


def test_worlds_differ_across_tasks_and_splits():
    tr, he, va = g.make_tasks("train", 50, seed=0), g.make_tasks("heldout", 50, seed=0), g.make_tasks("val", 50, seed=0)
    worlds = {tuple(sorted(t.facts.items())) for t in tr + he + va}
    assert len(worlds) == 150
    assert {len(t.golds) for t in g.make_tasks("val", 200)} == {1, 2, 3, 4, 5}  # like held-out
    with pytest.raises(ValueError, match="unknown split 'test'"):
        g.make_tasks("test", 5)
    assert g.make_tasks("train", 5, seed=0)[3] == tr[3]  # deterministic
    assert g.make_tasks("train", 5, seed=1)[3].facts != tr[3].facts


def test_objective_counts_and_hops():
    tr, he = g.make_tasks("train", 200), g.make_tasks("heldout", 200)
    assert {len(t.golds) for t in tr} == {1, 2, 3, 4}
    assert {len(t.golds) for t in he} == {1, 2, 3, 4, 5}
    assert all(2 <= h <= 3 for t in tr + he for h in t.hops)
    assert all(len(t.question.split(" ; ")) == len(t.golds) == len(t.hops) for t in tr + he)


def test_rl_tasks_are_the_training_tasks_with_enough_parts():
    """rl_min_objectives filters what RL draws; the training split (the warm start's) and the held-out
    split do not move; a value outside 1..max_objectives is refused in one line."""
    from config import config
    cfg = dict(config, gym='memory', model='tiny', max_objectives=2, train_tasks=60, eval_tasks=10, rl_min_objectives=1)
    every = g.setup(cfg)
    assert every['rl_tasks'] == every['train_tasks'] and {len(t.golds) for t in every['train_tasks']} == {1, 2}
    two = g.setup(dict(cfg, rl_min_objectives=2))
    assert two['train_tasks'] == every['train_tasks'] and two['eval_tasks'] == every['eval_tasks']
    assert two['rl_tasks'] == [t for t in every['train_tasks'] if len(t.golds) == 2] and two['rl_tasks']
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"'rl_min_objectives' must be 1..max_objectives \\(2\\), got {bad}"):
            g.setup(dict(cfg, rl_min_objectives=bad))
    with pytest.raises(ValueError, match=r"no training task has 2\+ parts \(rl_min_objectives\) among 1: "):
        g.setup(dict(cfg, train_tasks=1, seed=0, rl_min_objectives=2))  # its one task has a single part


def test_held_out_vocabulary_covered_by_training():
    words = lambda ts: {w for t in ts for w in (t.question + " " + " ".join(f"{k} {v}" for k, v in t.facts.items())).split()}
    assert words(g.make_tasks("heldout", 300)) <= words(g.make_tasks("train", 300))
    vocab = {w for x in g.memory_texts() for w in x.split()}
    assert words(g.make_tasks("train", 300)) <= vocab


def test_oracle_succeeds_with_only_folded_context():
    # play() hands the policy only (question, last mem, last obs): MemPO's folded context
    for split, n_obj, hops in [("train", None, (2, 3)), ("heldout", None, (2, 3)), ("heldout", (4, 4), (4, 4))]:
        for t in g.make_tasks(split, 100, seed=7, n_objectives=n_obj, hops=hops):
            turns, obs, r, info = g.play(t, g.oracle_policy)
            assert info["success"] and r == len(t.golds) and info["n_invalid"] == 0, (t.question, turns, obs)
            assert len(turns) == sum(t.hops) + 1
            vocab = {w for x in g.memory_texts() for w in x.split()}
            assert all(set(a.split()) <= vocab for a in turns + obs)
            full = ["<mem> " + a for a in turns]
            assert answers.extract_answer(full[-1]) == " ".join(g.answer_text(t).split()[1:-1])


def test_oracle_memory_keeps_the_root_of_the_pending_objective():
    q = "country of birthplace of director of moonfall ; founder of acme"
    assert g.oracle_mem(q, None, None) == "moonfall moonfall directed by born in located in"
    m = g.oracle_mem(q, "moonfall moonfall directed by born in located in", "moonfall directed by ada")
    assert m == "moonfall ada born in located in"
    assert g.oracle_mem(q, "moonfall ada born in located in", "ada born in varn") == "moonfall varn located in"
    # the last hop found: the segment becomes the answer and the objective after root moonfall opens
    m = g.oracle_mem(q, "moonfall varn located in", "varn located in arvenia")
    assert m == "arvenia ; acme acme founded by"
    assert g.oracle_policy(q, m, None) == f"{m} </mem> <search> acme founded by </search>"
    done = g.oracle_mem(q, "arvenia ; acme acme founded by", "acme founded by bo")
    assert done == "arvenia ; bo" and g.oracle_policy(q, "arvenia ; acme acme founded by", "acme founded by bo") \
        == "arvenia ; bo </mem> <answer> arvenia ; bo </answer>"
    # a fact that does not match the pending hop changes nothing
    assert g.oracle_mem(q, "moonfall ada born in located in", "bo born in varn") == "moonfall ada born in located in"


def test_memory_plans_reads_each_objectives_plan_and_answer():
    """scripts/memory_plans.py: the oracle plans and answers every objective right; a wrong relation in
    the second objective's plan, or an answer that stops after one part, is counted where it happens."""
    spec = importlib.util.spec_from_file_location("memory_plans", os.path.join(ROOT, "scripts", "memory_plans.py"))
    plans = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plans)
    task = next(t for t in g.make_tasks("heldout", 50, seed=3) if len(t.golds) == 3)
    turns, _, _, info = g.play(task, g.oracle_policy)
    assert info["success"]
    every = dict(opened=True, plan_right=True, plan_shorter=False, plan_longer=False, plan_other=False, answered=True,
                 right=True, right_after_right_plan=True)
    assert plans.part_outcomes(task, turns) == [every] * 3
    second = g._pending_chain(task.question.split(" ; ")[1])  # 'root root rel1 rel2 ...'
    swapped = "married to" if "married to" not in second else "born in"
    wrong = second.split()[:2] + swapped.split() + second.split()[4:]  # its first hop's relation swapped
    bad = [a.replace(second, " ".join(wrong)) for a in turns]
    assert bad != turns
    got = plans.part_outcomes(task, bad)
    assert got[0] == every and got[2] == every
    assert got[1] == dict(every, plan_right=False, plan_other=True, right_after_right_plan=False)  # same length
    opening = next(i for i, a in enumerate(turns) if second in a)
    rewritten = turns[:opening] + [bad[opening]] + turns[opening:]  # the wrong plan first, then the right one
    assert not plans.part_outcomes(task, rewritten)[1]["plan_right"]  # the first plan counts
    root = second.split()[0]
    once = [a.replace(second, root + " x " + " ".join(second.split()[2:])) for a in turns]  # root written once
    assert not plans.part_outcomes(task, once)[1]["opened"]
    cut = [a.replace(second, " ".join(second.split()[:-2])) for a in turns]  # its last hop dropped
    longer = [a.replace(second, second + " born in") for a in turns]  # one hop added
    assert plans.part_outcomes(task, cut)[1]["plan_shorter"] and not plans.part_outcomes(task, cut)[1]["plan_longer"]
    assert plans.part_outcomes(task, longer)[1]["plan_longer"] and not plans.part_outcomes(task, longer)[1]["plan_shorter"]
    first = task.golds[0][0]
    short = turns[:-1] + [f"{first} </mem> <answer> {first} </answer>"]  # one part answered, then stop
    got = plans.part_outcomes(task, short)
    assert got[0] == every and [o["answered"] for o in got] == [True, False, False]
    assert [o["right"] for o in got] == [True, False, False]
    assert plans.part_outcomes(task, []) == [dict.fromkeys(every, False)] * 3
    unscored = plans.part_outcomes(task, turns, answered=False)  # out of turns, or a refused answer turn
    assert [o["answered"] or o["right"] for o in unscored] == [False] * 3 and unscored[0]["plan_right"]
    counts = plans.tally([SimpleNamespace(task=task, info=dict(actions=turns, stop="answer")),
                          SimpleNamespace(task=task, info=dict(actions=short, stop="answer")),
                          SimpleNamespace(task=task, info=dict(actions=turns, stop="budget"))], "heldout")
    assert counts[("heldout", 3, 1)]["right"] == 2 and counts[("heldout", 3, 2)] == Counter(
        n=3, opened=3, plan_right=3, plan_shorter=0, plan_longer=0, plan_other=0, answered=1, right=1,
        right_after_right_plan=1)


def test_roots_distinct_within_a_question():
    for t in g.make_tasks("heldout", 300) + g.make_tasks("train", 300):
        roots = [q.split()[-1] for q in t.question.split(" ; ")]
        assert len(set(roots)) == len(roots)


def test_env_search_observations_and_errors():
    t = g.make_tasks("train", 1)[0]
    env = g.MemoryEnv()
    assert env.reset(t) == t.question
    key, val = next(iter(t.facts.items()))
    obs, r, done, info = env.step(f"x </mem> <search>  {key} </search>")
    assert obs == f"{key} {val}" and not done and r == 0.0
    obs, *_ = env.step("x </mem> <search> nobody born in </search>")
    assert obs == g.NO_RESULT
    obs, r, done, info = env.step("x </mem> <search> </search>")
    assert obs == g.BAD_FORMAT and not done and info["n_invalid"] == 1
    # right answer, but an earlier malformed turn: reward 0
    _, r, done, info = env.step("x </mem> <answer> " + " ; ".join(a[0] for a in t.golds) + " </answer>")
    assert done and r == 0.0 and info["em_count"] == len(t.golds) and not info["format_ok"] and not info["success"]


def test_env_partial_credit_and_budget():
    t = next(t for t in g.make_tasks("train", 50) if len(t.golds) == 2)
    env = g.MemoryEnv()
    env.reset(t)
    _, r, done, info = env.step(f"m </mem> <answer> {t.golds[0][0]} ; wrong </answer>")
    assert done and r == 1.0 and info["em_count"] == 1 and info["k"] == 2 and not info["success"]
    env = g.MemoryEnv(max_turns=2)
    env.reset(t)
    env.step("m </mem> <search> q </search>")
    _, r, done, info = env.step("m </mem> <search> q </search>")
    assert done and r == 0.0 and info["stop"] == "budget"


def test_all_or_nothing_reward_pays_only_a_complete_answer(capsys):
    """answer_reward='all': a two-part question pays 2 when both parts are right and 0 for one right
    part (em_count still 1, so EM is scored as before); success is the same under either reward."""
    t = next(t for t in g.make_tasks("train", 50) if len(t.golds) == 2)
    both, one = " ; ".join(a[0] for a in t.golds), f"{t.golds[0][0]} ; wrong"
    for how, answer, reward in [("all", both, 2.0), ("all", one, 0.0), ("em", both, 2.0), ("em", one, 1.0)]:
        env = g.MemoryEnv(answer_reward=how)
        env.reset(t)
        _, r, done, info = env.step(f"m </mem> <answer> {answer} </answer>")
        assert done and r == reward and info["success"] is (answer == both) and info["em_count"] == (2 if answer == both else 1)
    with pytest.raises(ValueError, match="config key 'answer_reward' expects one of em, f1, all, got 'All'"):
        g.MemoryEnv(answer_reward="All")
    from config import load_config
    gym_ = gym.load_gym(load_config(["config/tiny_mem.yaml", "--answer_reward=all", "--train_tasks=4", "--eval_tasks=4"]))
    env = gym_["make_env"]()
    env.reset(t)
    assert env.step(f"m </mem> <answer> {one} </answer>")[1] == 0.0
    with pytest.raises(SystemExit) as e:
        gym.load_gym(load_config(["config/tiny_mem.yaml", "--answer_reward=All"]))
    assert e.value.code == 2 and capsys.readouterr().err == "error: config key 'answer_reward' expects one of em, f1, all, got 'All'\n"


def test_complete_bonus_pays_only_a_complete_well_formed_answer():
    """complete_bonus: a two-part question pays em_count + bonus when both parts are right, em_count
    alone for one right part, and 0 for a malformed episode; the config key reaches the gym's env."""
    from config import load_config
    t = next(t for t in g.make_tasks("train", 50) if len(t.golds) == 2)
    both, one = " ; ".join(a[0] for a in t.golds), f"{t.golds[0][0]} ; wrong"
    env = gym.load_gym(load_config(["config/tiny_mem.yaml", "--complete_bonus=1.5", "--train_tasks=4", "--eval_tasks=4"]))["make_env"]()
    for answer, reward in [(both, 3.5), (one, 1.0)]:
        env.reset(t)
        _, r, done, info = env.step(f"m </mem> <answer> {answer} </answer>")
        assert done and r == reward and info["success"] is (answer == both)
    env.reset(t)
    env.step("m </mem> not a tool call")
    assert env.step(f"m </mem> <answer> {both} </answer>")[1] == 0.0
    with pytest.raises(SystemExit):
        load_config(["config/tiny_mem.yaml", "--complete_bonus=-1"])


def test_hop_reward_pays_the_question_hops_found_in_order():
    """hop_reward: a well-formed answer earns hop_reward * (hops found in the question's order) /
    (all hops) on top of its EM points; a hop of the second objective searched before the first
    objective is finished does not count, a wrong search counts nothing, and a malformed episode
    earns 0; the config key reaches the gym's env."""
    from config import load_config
    t = next(t for t in g.make_tasks("train", 50) if t.hops == [2, 3])
    (q1, q2), golds = t.question.split(" ; "), [a[0] for a in t.golds]
    chain = lambda q: [q.split(" of ")[-1]] + [g.NOUN_TO_REL[w] for w in reversed(q.split(" of ")[:-1])]

    def searches(q):  # the oracle's searches for one objective: entity + hop, in the chain's order
        e, out = chain(q)[0], []
        for rel in chain(q)[1:]:
            out.append(f"{e} {rel}")
            e = t.facts[f"{e} {rel}"]
        return out
    s1, s2 = searches(q1), searches(q2)
    env = gym.load_gym(load_config(["config/tiny_mem.yaml", "--hop_reward=1.0", "--train_tasks=4", "--eval_tasks=4"]))["make_env"]()
    wrong = f"{golds[0]} ; wrong"
    for done, answer, em, hops in [(s1 + s2, " ; ".join(golds), 2, 5), (s1, wrong, 1, 2), (s2[:1] + s1, wrong, 1, 2),
                                   (s2 + s1, wrong, 1, 2), (s1 + s2[:2], wrong, 1, 4), ([], "wrong ; wrong", 0, 0),
                                   (["nobody married to"] + s1[:1], "wrong ; wrong", 0, 1)]:
        env.reset(t)
        for q in done:
            _, _, over, info = env.step(f"m </mem> <search> {q} </search>")
            assert not over
        assert not done or info["hop_share"] == hops / 5  # an episode the rollout cuts here keeps its share
        _, r, finished, info = env.step(f"m </mem> <answer> {answer} </answer>")
        assert finished and r == pytest.approx(em + hops / 5) and info["hop_share"] == hops / 5
        assert g.progress(t, env.found)[2] == hops
    env.reset(t)
    env.step("m </mem> not a tool call")
    for q in s1 + s2:
        env.step(f"m </mem> <search> {q} </search>")
    assert env.step(f"m </mem> <answer> {' ; '.join(golds)} </answer>")[1] == 0.0
    env.reset(t)  # every hop found, then out of turns (the gym's budget, 2 + 5): a truncated episode earns 0
    steps = [env.step(f"m </mem> <search> {q} </search>") for q in (s1 + s2 + s2)[:env.budget]]
    assert steps[-1][2] and steps[-1][3]["stop"] == "budget" and steps[-1][3]["hop_share"] == 1.0
    assert steps[-1][1] == 0.0
    with pytest.raises(SystemExit):
        load_config(["config/tiny_mem.yaml", "--hop_reward=-1"])


def test_baselines_are_weak():
    ts = g.make_tasks("train", 200)
    assert sum(g.play(t, g.any_answer_policy)[2] for t in ts) == 0
    pol = g.make_random_policy(random.Random(0))
    assert sum(g.play(t, pol)[3]["success"] for t in ts) < 10


def test_answer_text_format():
    t = g.MemoryTask("x", "q1 ; q2", [["oslo"], ["ada"]], {}, [2, 2])
    assert g.answer_text(t) == "<answer> oslo ; ada </answer>"


# -----------------------------------------------------------------------------
# turns cut at max_response_tokens (rollout's finish='length')


def test_cut_turn_is_malformed_whatever_its_text():
    t = g.make_tasks("train", 1, n_objectives=(1, 1))[0]
    env = g.MemoryEnv()
    env.reset(t)
    key = next(iter(t.facts))
    obs, r, done, info = env.step(f"x </mem> <search> {key} </search>", "length")  # well formed, not searched
    assert (obs, r, done, info["n_invalid"]) == (g.BAD_FORMAT, 0.0, False, 1)
    _, r, done, info = env.step(f"x </mem> <answer> {t.golds[0][0]} </answer>")  # right, but turn 1 was cut
    assert done and r == 0.0 and not info["success"] and info["format_reason"] == "turn 1: cut at the response length limit"
    env.reset(t)
    _, r, done, info = env.step(f"x </mem> <answer> {t.golds[0][0]} </answer>", "length")
    assert not done and r == 0.0 and info["n_invalid"] == 1


MEM_TOK = gym.build_tokenizer(g.memory_texts())
MEM_STOPS = [MEM_TOK.stoi["</search>"], MEM_TOK.stoi["</answer>"]]
MEM_TASK = g.make_tasks("train", 1, seed=3, n_objectives=(1, 1), hops=(2, 2))[0]
_K = next(iter(MEM_TASK.facts))
MEM_TURNS = [MEM_TOK.encode(s) for s in (f"ada </mem> <search> {_K} </search>", "ada </mem> <think> bo </think> <search> of </search>",
                                         f"ada </mem> <answer> {MEM_TASK.golds[0][0]} </answer>", "ada ; bo </mem> <answer> cyd </answer>",
                                         f"ada </mem> <search> {_K} </search> <answer> bo </answer>")]
WORDS = st.lists(st.sampled_from(sorted(set(i for s in MEM_TURNS for i in s)) + [MEM_TOK.stoi["<nl>"], MEM_TOK.stoi["<mem>"]]),
                 max_size=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(WORDS, st.tuples(st.sampled_from(MEM_TURNS), st.integers(0, 14)).map(lambda c: c[0][:c[1]])),
                min_size=1, max_size=8))
def test_finish_length_steps_exactly_as_the_unterminated_text_did(turns):
    # the tiny gym's numbers must not move: a turn without its stop token (</search>, </answer>) never
    # passed the format check (every id decodes to one word), so 'length' changes nothing
    new, old = g.MemoryEnv(), g.MemoryEnv()
    new.reset(MEM_TASK), old.reset(MEM_TASK)
    for ids in turns:
        finish = "stop" if ids and ids[-1] in MEM_STOPS else "length"  # rollout.py's rule
        text = MEM_TOK.decode(ids)
        a, b = new.step(text, finish), old.step(text)  # old: no finish argument (the code before it)
        assert a == b
        if a[2]:
            break


# -----------------------------------------------------------------------------
# memory quality and the lossy oracle


def _world_task():
    """A hand-built world: 'founder of producer of moonfall ; birthplace of ada'."""
    facts = {"moonfall produced by": "acme", "acme founded by": "ada", "ada born in": "varn",
             "bo born in": "pell"}
    return g.MemoryTask("t", "founder of producer of moonfall ; birthplace of ada", [["ada"], ["varn"]], facts)


def test_needed_entities_on_a_hand_built_world():
    t = _world_task()
    assert g.needed_entities(t, {}) == []  # roots are in the question
    assert g.needed_entities(t, {"moonfall produced by": [1]}) == ["acme"]
    assert g.needed_entities(t, {"moonfall produced by": [1], "acme founded by": [2]}) == ["ada"]
    # objective 1 done at turn 2: objective 2 starts; its first hop counts only when found after that
    assert g.needed_entities(t, {"moonfall produced by": [1], "acme founded by": [2], "ada born in": [3]}) == ["ada", "varn"]
    assert g.needed_entities(t, {"ada born in": [1], "moonfall produced by": [2], "acme founded by": [3]}) == ["ada"]
    assert g.needed_entities(t, {"bo born in": [1]}) == []  # a fact no objective needs
    # a hop found before the hop it follows is not progress: the agent has to search it again
    assert g.needed_entities(t, {"acme founded by": [1], "moonfall produced by": [2]}) == ["acme"]


def test_memory_quality_on_hand_built_memories():
    t = _world_task()
    found = {"moonfall produced by": [1], "acme founded by": [2], "ada born in": [3]}  # needs ada and varn
    assert g.memory_quality(t, "<mem> ada ; varn </mem> <answer> ada ; varn </answer>", found) == 1.0
    assert g.memory_quality(t, "<mem> ada ; moonfall </mem> <search> x </search>", found) == 0.5
    assert g.memory_quality(t, "<mem> Ada, and Varn. </mem>", found) == 1.0  # words, any case or punctuation
    assert g.memory_quality(t, "<mem> </mem> <answer> ada ; varn </answer>", found) == 0.0  # only <mem> counts
    assert g.memory_quality(t, "no mem block at all", found) == 0.0
    assert g.memory_quality(t, "<mem> ada </mem>", {}) is None  # nothing needed yet


def test_oracle_memory_quality_is_one_and_logged_per_turn():
    for t in g.make_tasks("train", 200, seed=3, n_objectives=(1, 4)):
        turns, _, _, info = g.play(t, g.oracle_policy)
        q = info["mem_quality_turns"]
        assert len(q) == len(turns) and q[0] is None
        assert all(x == 1.0 for x in q if x is not None) and info["mem_quality"] in (1.0, None)


def test_lossy_oracle_never_writes_what_it_forgot():
    tasks = g.make_tasks("train", 300, seed=4, n_objectives=(2, 3))
    for t in tasks:
        golds = [x[0] for x in t.golds]
        turns, _, reward, info = g.play(t, g.make_lossy_oracle(random.Random(0), 1.0))  # forgets every answer but the last
        assert [p.strip() for p in info["answer"].split(";")] == [""] * (len(golds) - 1) + [golds[-1]]
        assert reward == 1.0 and info["format_ok"] and info["mem_quality"] < 1.0
        for tx in turns:  # every closed objective's slot is empty: its answer is never written again
            slots = answers.extract_mem("<mem> " + tx).split(";")
            assert all(s.strip() == "" for s in slots[:-1]), tx
    p0 = g.make_lossy_oracle(random.Random(0), 0.0)
    for t in tasks[:50]:  # forgetting with probability 0 is the oracle, turn for turn
        assert g.play(t, p0)[0] == g.play(t, g.oracle_policy)[0]
    forgot = [g.play(t, g.make_lossy_oracle(random.Random(i), 0.5))[3]["answer"].split(";")[0].strip() == ""
              for i, t in enumerate(tasks)]
    assert 0.4 < sum(forgot) / len(forgot) < 0.6  # objective 1 is forgotten about half the time at p = 0.5


def test_detour_oracle_makes_one_untrained_wrong_search_then_recovers_within_the_budget():
    tasks = g.make_tasks("train", 200, seed=5, n_objectives=(1, 3))
    for i, t in enumerate(tasks):
        said = []
        detour = g.with_detour(random.Random(i), 1.0, g.oracle_policy)
        turns, obs, reward, info = g.play(t, lambda q, m, o: said.append(detour(q, m, o)) or said[-1])
        oracle_turns = g.play(t, g.oracle_policy)[0]
        wrong = [j for j, a in enumerate(said) if isinstance(a, tuple)]
        assert len(wrong) == 1 and said[wrong[0]][1] is False  # exactly one mistake, marked not to train
        j = wrong[0]
        wrong_q, right_q = (answers.extract_tag("<mem> " + turns[k], "search").split() for k in (j, j + 1))
        assert wrong_q[0] == right_q[0] and wrong_q[1:] != right_q[1:] and " ".join(wrong_q[1:]) in g.RELATIONS
        assert turns[:j] + turns[j + 1:] == oracle_turns  # every other turn, the recovery included, is the oracle's
        assert answers.extract_mem("<mem> " + turns[j]) == answers.extract_mem("<mem> " + turns[j + 1])
        assert info["stop"] == "answer" and reward == len(t.golds) and info["format_ok"], info
    never = g.with_detour(random.Random(0), 0.0, g.oracle_policy)
    assert all(g.play(t, never)[0] == g.play(t, g.oracle_policy)[0] for t in tasks[:50])
    half = [any(isinstance(a, tuple) for a in _said(t, g.with_detour(random.Random(i), 0.5, g.oracle_policy)))
            for i, t in enumerate(tasks)]
    assert 0.4 < sum(half) / len(half) < 0.6


def test_stuck_oracle_repeats_an_untrained_wrong_search_and_answers_its_notes_on_the_last_turn():
    """oracle_stuck's lesson: one wrong search, repeated untrained until 'turns left 1', then a trained answer
    of what the notes hold, in the budget's last turn; the oracle's turns before it are unchanged."""
    tasks = g.make_tasks("train", 200, seed=5, n_objectives=(1, 3))
    for i, t in enumerate(tasks):
        env = g.MemoryEnv(show_budget=True, turn_limit=10)
        said = []
        stuck = g.with_detour(random.Random(i), 1.0, g.oracle_policy, stuck=True)
        turns, obs, reward, info = g.play(t, lambda q, m, o: said.append(stuck(q, m, o)) or said[-1], env)
        wrong = [j for j, a in enumerate(said) if isinstance(a, tuple)]
        assert wrong == list(range(wrong[0], len(said) - 1)) and all(said[j][1] is False for j in wrong)
        assert len({said[j][0] for j in wrong[1:]}) <= 1  # the same wrong search, again and again
        assert turns[:wrong[0]] == g.play(t, g.oracle_policy)[0][:wrong[0]]
        assert len(turns) == min(env.budget, 10) and obs[-2].endswith("turns left 1")
        assert info["stop"] == "answer" and info["format_ok"], info
        notes = answers.extract_mem("<mem> " + turns[-1])
        assert notes == answers.extract_mem("<mem> " + turns[wrong[0]])
        resolved = [s.split()[0] for s in notes.split(";") if len(s.split()) == 1]  # the answers found before
        assert [p.strip() for p in info["answer"].split(";")][:len(resolved)] == resolved
        assert reward == len(resolved) and len(info["answer"].split(";")) == len(t.golds)
    assert g._answer_from_notes("a of x ; b of c of y ; d of z", "castor ; y dag married to") == "castor ; dag ; z"
    assert g._answer_from_notes("a of x ; b of y", " ; y dag married to") == "x ; dag"  # a forgotten slot: its root
    assert g._turns_left("no result\nturns left 3") == 3 and g._turns_left("no result") is None
    never = g.with_detour(random.Random(0), 0.0, g.oracle_policy, stuck=True)
    assert all(g.play(t, never)[0] == g.play(t, g.oracle_policy)[0] for t in tasks[:50])


def test_stuck_oracle_needs_show_budget_and_is_not_combined_with_detours():
    from config import config
    cfg = dict(config, gym='memory', model='tiny', max_objectives=2, train_tasks=20, eval_tasks=4, oracle_stuck=0.5)
    with pytest.raises(ValueError, match="'oracle_stuck' needs show_budget: true"):
        g.setup(cfg)
    with pytest.raises(ValueError, match="'oracle_detour' and 'oracle_stuck' are each one wrong search an episode"):
        g.setup(dict(cfg, show_budget=True, oracle_detour=0.5))


def _said(task, policy):
    said = []
    g.play(task, lambda q, m, o: said.append(policy(q, m, o)) or said[-1])
    return said


def test_show_budget_counts_down_the_turns_left_and_the_oracle_still_succeeds():
    tasks = g.make_tasks("heldout", 60, seed=3)
    for t in tasks:
        env = g.MemoryEnv(show_budget=True, turn_limit=10)
        turns, obs, reward, info = g.play(t, g.oracle_policy, env)
        plain_turns, plain_obs = g.play(t, g.oracle_policy)[:2]
        assert info["success"] and turns == plain_turns  # the budget line changes no oracle turn
        budget = min(2 + sum(t.hops), 10)  # the rollout's max_turns ends a long episode first; play() does not: 0 stays 0
        assert [o.split("\n")[-1] for o in obs[:-1]] == [f"turns left {max(0, budget - n)}" for n in range(1, len(turns))]
        assert all(o.split("\n")[0] == p for o, p in zip(obs, plain_obs))  # the fact line unchanged
    # a wasted turn is counted too; the last line before the budget ends reads 1
    t = next(t for t in tasks if sum(t.hops) == 4)
    env = g.MemoryEnv(show_budget=True)
    env.reset(t)
    seen = [env.step("m </mem> <search> nobody born in </search>")[0] for _ in range(5)]
    assert seen == [f"{g.NO_RESULT}\nturns left {n}" for n in (5, 4, 3, 2, 1)]
    _, r, done, info = env.step("m </mem> <search> nobody born in </search>")
    assert done and r == 0.0 and info["stop"] == "budget"


def test_rl_spare_turns_tightens_the_budget_of_rl_episodes_only():
    """rl_spare_turns: 0 gives RL episodes exactly the oracle's turns (one search per hop, then the
    answer), so one wasted search leaves the last turn to answer what the notes hold; the training
    tasks (the warm start's and PPO-ptx's), held-out and validation keep the spare turn."""
    from config import config, load_config
    cfg = dict(config, gym='memory', model='tiny', max_objectives=2, train_tasks=40, eval_tasks=10, val_tasks=4,
               show_budget=True, max_turns=10)
    one, zero = g.setup(cfg), g.setup(dict(cfg, rl_spare_turns=0))
    assert [(t.question, t.spare_turns) for t in one['rl_tasks']] == [(t.question, 1) for t in one['train_tasks']]
    assert [(t.question, t.spare_turns) for t in zero['rl_tasks']] == [(t.question, 0) for t in one['train_tasks']]
    assert all(t.spare_turns == 1 for s in ('train_tasks', 'eval_tasks', 'val_tasks') for t in zero[s])
    for t in zero['rl_tasks']:  # the oracle still fits, with no turn to spare
        env = zero['make_env']()
        turns, obs, reward, info = g.play(t, g.oracle_policy, env)
        assert info['success'] and len(turns) == env.budget == 1 + sum(t.hops) and obs[-2].endswith('turns left 1')
    t = next(t for t in zero['rl_tasks'] if len(t.golds) == 1 and sum(t.hops) == 2)
    env = zero['make_env']()
    env.reset(t)  # two searches (a wasted one, then a fact of the world): the third turn is the last one
    seen = [env.step(f"m </mem> <search> {q} </search>")[0] for q in ('nobody born in', next(iter(t.facts)))]
    assert [o.split('\n')[-1] for o in seen] == ['turns left 2', 'turns left 1']
    _, r, done, info = env.step("m </mem> <search> nobody born in </search>")
    assert done and r == 0.0 and info['stop'] == 'budget' and info['n_turns'] == 3
    with pytest.raises(SystemExit):
        load_config(['config/tiny_mem.yaml', '--rl_spare_turns=-1'])


def test_show_budget_words_are_in_the_tiny_vocabulary_only_when_on():
    from config import config as defaults, load_config
    args = ["config/tiny_mem.yaml", "--train_tasks=4", "--eval_tasks=4"]
    cfg_on = load_config(args + ["--show_budget=true"])
    off, on = gym.load_gym(load_config(args)), gym.load_gym(cfg_on)
    added = {"turns", "left"} | {str(n) for n in range(cfg_on["max_turns"] + 1)}
    assert set(on["tok"].itos) - set(off["tok"].itos) == added and not added & set(off["tok"].itos)
    t = on["eval_tasks"][0]
    env = on["make_env"]()
    env.reset(t)
    obs = env.step("x </mem> <search> nobody born in </search>")[0]
    assert obs == f"{g.NO_RESULT}\nturns left {min(2 + sum(t.hops), cfg_on['max_turns']) - 1}"
    on["fmt"].observation(obs)  # every word encodes (OutOfVocabulary otherwise)
    with pytest.raises(gym.OutOfVocabulary):
        off["fmt"].observation(obs)
    with pytest.raises(SystemExit):  # a gym that shows no budget refuses the key
        gym.load_gym(load_config(["config/tiny.yaml", "--show_budget=true"]), None, defaults)
