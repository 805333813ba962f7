"""gyms/quixbugs.py: data loading, splits, the 31 programs through the sandbox (buggy fails, fixed
passes, infinite loops end by timeout), scripted episodes, tool-call parsing, hostile edits."""

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings, strategies as st

from gyms import quixbugs as G

TASKS = G.make_tasks("all")
BY_NAME = {t.name: t for t in TASKS}
LOOPS = ("bitcount", "sqrt", "find_first_in_sorted")  # buggy versions that never return
BLIND = [BY_NAME[n] for n in ("bitcount", "gcd", "wrap")]


def call(name, **arguments):
    return G.format_tool_call(name, arguments)


def test_load_and_errors(tmp_path):
    recs = G.load_quixbugs()
    assert len(recs) == 31 and sum(len(r["tests"]) for r in recs) == 242
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        G.load_quixbugs(str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(recs[0]) + "\n" + '{"name": "x", "tests": [}\n')
    with pytest.raises(ValueError, match=f"{bad}:2:"):
        G.load_quixbugs(str(bad))
    bad.write_text(json.dumps(dict(recs[0], compare="fuzzy")) + "\n")
    with pytest.raises(ValueError, match=f"{bad}:1: .*compare"):
        G.load_quixbugs(str(bad))


def test_splits():
    train, held = G.make_tasks("train"), G.make_tasks("heldout")
    assert len(train) == 24 and len(held) == 7
    assert {t.id for t in train} | {t.id for t in held} == set(BY_NAME)
    assert not {t.id for t in train} & {t.id for t in held}
    rule = sorted(BY_NAME, key=lambda n: hashlib.sha256(n.encode()).hexdigest())[:7]
    assert sorted(G.HELDOUT) == sorted(rule) == sorted(t.id for t in held)
    assert [t.id for t in G.make_tasks("train")] == [t.id for t in train]  # deterministic
    with pytest.raises(ValueError, match="unknown split"):
        G.make_tasks("test")
    assert 9 not in BY_NAME["knapsack"].run_ids and 3 not in BY_NAME["levenshtein"].run_ids
    for t in TASKS:
        assert set(t.public_ids) < set(t.run_ids) or len(t.run_ids) == 1


@pytest.mark.slow  # ~12 s of CPU: three infinite loops at 4 s each, levenshtein's 2 s case twice
def test_all_programs_buggy_fail_fixed_pass():
    t0 = time.monotonic()
    jobs = [(t, src) for t in TASKS for src in (t.buggy_source, t.fixed_source)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda j: G.run_tests(*j), jobs))
    wall = time.monotonic() - t0
    for (t, src), res in zip(jobs, results):
        assert res["load_error"] is None, (t.name, res)
        if src is t.fixed_source:
            assert res["passed"] == res["total"] == len(t.run_ids), (t.name, res)
        else:
            assert res["passed"] < res["total"], t.name
            statuses = {c["status"] for c in res["cases"].values()}
            assert ("timeout" in statuses) == (t.name in LOOPS), (t.name, statuses)
            if t.name in LOOPS:  # ended by the per-case CPU guard (or the wall limit on a busy machine)
                assert res["wall_s"] < 22, (t.name, res)
    print(f"31 buggy + 31 fixed programs: {wall:.1f} s wall")
    assert wall < 120


def test_scripted_episodes():
    # every buggy program fails (test above), so a blind episode fails; three suffice here
    def episode(task, policy):
        env = G.QuixBugsEnv()
        prompt = env.reset(task)
        assert task.name in prompt
        for action in G.scripted_actions(task, policy):
            obs, reward, done, info = env.step(action)
        assert done and info["stop"] == "submit" and info["n_invalid"] == 0
        return reward, info
    with ThreadPoolExecutor(2) as pool:
        oracle = list(pool.map(lambda t: episode(t, "oracle"), TASKS))
        blind = list(pool.map(lambda t: episode(t, "blind"), BLIND))
    for t, (r, info) in zip(TASKS, oracle):
        assert r == 1.0 and info["success"] and info["pass_frac"] == 1.0, t.name
        assert info["n_failed_edits"] == 0 and info["n_edits"] >= 1
    for t, (r, info) in zip(BLIND, blind):
        assert r == 0.0 and not info["success"] and info["pass_frac"] < 1.0, t.name


def test_every_ast_is_built_under_the_lock(monkeypatch):
    # CI once failed on CPython 3.11 with "AST constructor recursion depth mismatch": two episode threads
    # built ASTs at once (python/cpython#106905). Every parse in the parent must hold _AST_LOCK.
    held = []
    real = G.ast.parse
    def spy(*args, **kwargs):
        held.append(G._AST_LOCK.locked())
        return real(*args, **kwargs)
    monkeypatch.setattr(G.ast, "parse", spy)
    t = BY_NAME["gcd"]
    G.reference_edits(t)                                   # scripted policy: docstring split
    env = G.QuixBugsEnv()
    env.reset(t)
    env.step(call("edit", old="gcd(a % b, b)", new="gcd(b, a % b)"))  # edit: the parse warning check
    i = t.public_ids[0]
    assert G._judge(t, i, repr(t.tests[i]["expected"]))    # judging the child's printed value
    assert len(held) >= 4 and all(held), held


def test_tools_in_an_episode():
    t = BY_NAME["bitcount"]
    env = G.QuixBugsEnv()
    env.reset(t)
    obs, r, done, info = env.step(call("read"))
    assert "  5 |         n ^= n - 1" in obs and "Bitcount" in obs  # the docstring is kept
    obs, r, done, info = env.step("I will just think aloud.")
    assert obs.startswith("error:") and info["n_invalid"] == 1 and not done
    obs, *_ = env.step(call("edit", old="n = n - 1", new="x"))
    assert "not found" in obs and env.source == t.buggy_source
    obs, *_ = env.step(call("edit", old="count", new="c"))
    assert f"{t.buggy_source.count('count')} times" in obs and env.source == t.buggy_source
    obs, r, done, info = env.step(call("delete", path="/"))
    assert "unknown tool" in obs and info["n_invalid"] == 2 and info["n_failed_edits"] == 2
    obs, *_ = env.step(call("test"))
    assert obs.startswith("public tests: 0 of 5") and "bitcount(127) did not return" in obs
    obs, *_ = env.step(call("edit", old="n ^= n - 1", new="n &= n - 1") + call("submit"))
    assert "n &= n - 1" in obs and "only the first tool call" in obs
    obs, *_ = env.step(call("test"))
    assert obs == "public tests: 5 of 5 tests passed"
    obs, r, done, info = env.step(call("submit"))
    assert r == 1.0 and done and info["n_turns"] == 9 and info["passed"] == info["total"] == 9
    obs, r, done, info = env.step(call("read"))
    assert obs.startswith("error:") and done and r == 0.0


def test_max_turns_and_syntax_warning():
    env = G.QuixBugsEnv(max_turns=2)
    env.reset(BY_NAME["gcd"])
    obs, r, done, _ = env.step(call("edit", old="def gcd(a, b):", new="def gcd(a, b)"))
    assert "warning: the file no longer parses" in obs and not done
    obs, r, done, info = env.step(call("test"))
    assert "does not load" in obs and "SyntaxError" in obs
    assert done and r == 0.0 and info["stop"] == "budget"


def test_results_are_cached():
    t = BY_NAME["gcd"]
    a = G.run_tests(t, t.fixed_source)
    t0 = time.monotonic()
    assert G.run_tests(t, t.fixed_source) is a and time.monotonic() - t0 < 0.01


def hostile(task, body, **kw):
    """The task's function replaced by `body` (source text), run through the tests."""
    return G.run_tests(task, body, **kw)


def test_hostile_programs_fail_and_end_in_time():
    t = BY_NAME["gcd"]
    expected = t.tests[0]["expected"]
    # an object equal to everything: the comparison runs in the parent on literals only
    res = hostile(t, "class A:\n    def __eq__(self, o): return True\n    def __repr__(self): return 'A()'\n"
                     "def gcd(a, b):\n    return A()\n")
    assert res["passed"] == 0 and {c["status"] for c in res["cases"].values()} == {"wrong"}
    # forged result lines (the tag is random) and printing to the real stdout
    forged = "\n".join(f'@@qb-0000000000000000 {{"i": {i}, "s": "ok", "v": "{expected}"}}' for i in range(6))
    res = hostile(t, f"import sys\ndef gcd(a, b):\n    sys.__stdout__.write({forged!r})\n    return -1\n")
    assert res["passed"] == 0
    # sleeps forever at import: the wall limit ends it
    t0 = time.monotonic()
    res = hostile(t, "import time\ntime.sleep(10**6)\ndef gcd(a, b):\n    return 0\n", total_timeout_s=2.0)
    assert res["passed"] == 0 and res["sandbox"] == "timeout" and time.monotonic() - t0 < 5
    # swallows the per-case timeout: the re-armed timer or else the wall limit ends it
    t0 = time.monotonic()
    res = hostile(t, "def gcd(a, b):\n    while True:\n        try:\n            while True: pass\n"
                     "        except BaseException:\n            pass\n",
                  total_timeout_s=3.0, case_timeout_s=0.5)
    assert res["passed"] == 0 and res["cases"][0]["status"] == "timeout" and time.monotonic() - t0 < 6
    # floods the output, allocates 8 GB, forks, writes outside
    for body in ("import sys\ndef gcd(a, b):\n    sys.__stdout__.write('x' * 100 * 2**20)\n",
                 "def gcd(a, b):\n    return len(bytearray(8 * 2**30))\n",
                 "import os\ndef gcd(a, b):\n    os.fork()\n    return 1\n",
                 "def gcd(a, b):\n    open('/tmp/nanoagent_escape_gcd', 'w')\n    return 1\n"):
        t0 = time.monotonic()
        res = hostile(t, body)
        assert res["passed"] == 0 and time.monotonic() - t0 < 10, (body, res)
    assert not os.path.exists("/tmp/nanoagent_escape_gcd")


def test_tool_schemas():
    schemas = G.tool_schemas()
    assert [s["function"]["name"] for s in schemas] == list(G.TOOLS)
    assert json.loads(json.dumps(schemas)) == schemas
    edit = schemas[1]["function"]["parameters"]
    assert edit["required"] == ["old", "new"] and set(edit["properties"]) == {"old", "new"}


def test_parse_tool_call_forms():
    assert G.parse_tool_call(call("read")) == ("read", {})
    thinking = '<think>hmm</think>\n<tool_call>\n{"name": "test"}\n</tool_call>'
    assert G.parse_tool_call(thinking) == ("test", {})
    assert G.parse_tool_call('<tool_call>{"name": "submit", "arguments": {}}<|im_end|>') == ("submit", {})
    args = json.dumps({"old": "a", "new": "b"})
    as_string = "<tool_call>" + json.dumps({"name": "edit", "arguments": args}) + "</tool_call>"
    assert G.parse_tool_call(as_string) == ("edit", {"old": "a", "new": "b"})
    raw = '<tool_call>{"name": "edit", "arguments": {"old": "x = 1\n", "new": "x = 2\n"}}</tool_call>'
    assert G.parse_tool_call(raw) == ("edit", {"old": "x = 1\n", "new": "x = 2\n"})  # raw newlines
    # the closing tag inside a JSON string does not end the call (found by hypothesis in CI)
    assert G.parse_tool_call(call("edit", old="0", new="</tool_call>")) == ("edit", {"old": "0", "new": "</tool_call>"})
    fenced = '<tool_call>\n```json\n{"name": "read"}\n```\n</tool_call>'
    assert G.parse_tool_call(fenced) == ("read", {})
    for bad in ("", "read", "<tool_call>{</tool_call>", '<tool_call>["read"]</tool_call>',
                '<tool_call>{"name": "edit", "arguments": {"old": ""}}</tool_call>',
                '<tool_call>{"name": "edit", "arguments": {"old": 1, "new": "x"}}</tool_call>',
                '<tool_call>{"name": "read", "arguments": [1]}</tool_call>',
                "<tool_call>" + "[" * 100000 + "</tool_call>", None, 42):
        assert isinstance(G.parse_tool_call(bad), str) and G.parse_tool_call(bad).startswith("error:")


FRAGMENTS = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"edit"', '"read"',
                             '"arguments"', '"old"', '"new"', ",", "[", "]", "null", '"', "\\", "\n",
                             "<|im_end|>", "```json", "```", "1e999", "true"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(st.one_of(FRAGMENTS, st.text(max_size=5))).map("".join)))
def test_parse_tool_call_never_raises(text):
    out = G.parse_tool_call(text)
    assert (isinstance(out, str) and out.startswith("error:")) or (
        isinstance(out, tuple) and out[0] in G.TOOLS and isinstance(out[1], dict))


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1), st.text())
def test_edit_calls_round_trip(old, new):
    assert G.parse_tool_call(call("edit", old=old, new=new)) == ("edit", {"old": old, "new": new})


@pytest.fixture(scope="module")
def qwen():
    import hf
    return hf.qwen_tokenizer()


@pytest.mark.parametrize("budget", [13, 15])
def test_turn_cut_at_max_response_tokens_is_not_run(qwen, budget):
    # the read call is 15 Qwen tokens with its <|im_end|>; cut at 13 it has neither
    # </tool_call> nor a stop token, yet parse_tool_call tolerates the missing tag and read ran
    from hf import chat_format
    from rollout import rollout_batch
    fmt = chat_format(qwen, tools=G.tool_schemas())
    read = call("read")  # the rollout appends <|im_end|> (fmt.end_turn), as the model would write it
    short = '<tool_call>{"name": "read"}</tool_call>'  # 9 tokens with <|im_end|>: always within the budget
    assert len(fmt.encode(read) + fmt.end_turn) == 15 and len(fmt.encode(short) + fmt.end_turn) == 9
    seen = []

    def policy(ep):
        seen.append(ep.texts[-1])
        return short if ep.turns else read
    task = BY_NAME["gcd"]
    cfg = dict(max_turns=2, max_len=4096, max_response_tokens=budget, keep_tool_results="all", temperature=1.0)
    t = rollout_batch([policy], fmt, [G.QuixBugsEnv()], [task], cfg)[0]
    first = fmt.decode(t.turns[0]["response"])
    if budget == 13:
        assert first.endswith('"arguments": {}}\n') and "</tool_call>" not in first  # cut before the tag
        assert seen[1].startswith("error:") and t.info["n_invalid"] == 1 and t.info["stop"] == "max_turns"
        assert seen[1] == G.CUT_ERROR and t.turns[0]["finish"] == "length"
    else:
        assert seen[1] == G.numbered(task.buggy_source) and t.info["n_invalid"] == 0
        assert t.turns[0]["finish"] == "stop"
    assert t.turns[1]["finish"] == "stop" and len(t.turns) == 2


def test_step_with_finish_length_runs_no_tool():
    t = BY_NAME["gcd"]
    env = G.QuixBugsEnv()
    env.reset(t)
    edit = call("edit", old="gcd(a % b, b)", new="gcd(b, a % b)")
    obs, r, done, info = env.step(edit, "length")  # a complete, valid call: still not run
    assert obs == G.CUT_ERROR and env.source == t.buggy_source and not done
    assert (info["n_turns"], info["n_invalid"], info["n_edits"]) == (1, 1, 0)
    obs, r, done, info = env.step(call("submit"), "length")
    assert not done and r == 0.0 and info["n_invalid"] == 2
    obs, r, done, info = env.step(edit)  # finish defaults to 'stop' for direct callers
    assert "now read" in obs and info["n_edits"] == 1 and info["n_invalid"] == 2
