"""
QuixBugs: 31 real one-line bugs in small Python programs, fixed by a real model with free-form edits.

    tasks = make_tasks("train")                      # 24 programs; "heldout": 7; "all": 31
    env = QuixBugsEnv()
    prompt = env.reset(tasks[0])
    obs, reward, done, info = env.step('<tool_call>{"name": "read", "arguments": {}}</tool_call>')

Choices (documented here because they shape the reward):
- The agent sees the upstream buggy file; its trailing docstring is the problem statement (input, output,
  examples). Tests are upstream's JSON cases, without `slow_tests` (knapsack #9, levenshtein #3), as upstream.
- Tools (Qwen-style calls, as above): `read` (the file with line numbers), `edit` (replace the exact text
  `old`, which must occur once, by `new`), `test` (the public tests: the first half of the cases; counts and
  the first failure), `submit` (ends the episode). Only the first tool call of a turn is run.
- Reward: 1.0 if the submitted program passes ALL its cases (public and hidden), else 0.0; not the
  fraction (info['pass_frac']): the buggy programs already pass many cases, so it rewards doing nothing.
- Split: HELDOUT (7 programs, the first 7 names in sha256 order, fixed here) vs the 24 others.
- Tests run in sandbox.py, all cases of one program in ONE process: a harness execs the program and
  calls it on each case under a per-case CPU-time guard (case_timeout_s, default 4 s); after a timeout
  the remaining cases count as failed, so an infinite loop costs one case_timeout_s. A wall limit
  (total_timeout_s, default 20 s) also ends code that sleeps. The child only prints what the program
  returned (repr); the parent compares it with the expected values, so the hidden answers never enter
  the sandbox (nor a file it can read: gyms/sandbox.py, HIDDEN_DIRS) and an __eq__ that always says True
  gains nothing. Records the harness did not write make the run FORGED (0 tests pass, _parse_report).
  Results are cached by (program, source text).
- Simplified: one file per task; no imports between programs (the 31 JSON-tested programs need
  none); `read` always shows the whole file (at most ~60 lines).
"""

import ast
import difflib
import hashlib
import json
import math
import os
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

import hf
from gym import read_jsonl
from gyms import sandbox

MODEL = "hf"
KEYS = ("enable_thinking",)
DATA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "quixbugs.jsonl")
COMPARES = ("exact", "list", "list_of_tuples", "approx_abs_last_arg")
# sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())[:7], fixed so that data edits
# cannot silently move programs between splits
HELDOUT = ("find_first_in_sorted", "find_in_sorted", "flatten", "lcs_length", "next_palindrome", "rpn_eval",
           "subsequences")
MAX_SOURCE_CHARS = 20000   # an edit that makes the file larger is refused
MAX_REPR_CHARS = 20000     # a returned value whose repr is longer counts as a wrong answer
SHOW_CHARS = 200           # longest argument / value text shown in a test report


@dataclass(frozen=True, eq=False)
class QuixTask:
    id: str                # the program name
    name: str              # the function name == file stem
    buggy_source: str      # what the agent starts from (trailing docstring included)
    fixed_source: str      # the reference fix (never shown)
    tests: tuple           # ({'args': list, 'expected': ...}, ...) all upstream cases
    compare: str           # one of COMPARES
    run_ids: tuple         # indices into tests that are run (upstream's slow ones left out)
    public_ids: tuple      # the subset `test` runs and shows: the first half of run_ids


def load_quixbugs(path=DATA_PATH):
    """Read the QuixBugs JSONL (one program per line) into a list of dict records.
    Raises FileNotFoundError (missing file) or ValueError naming `file:line` (malformed record)."""
    records = []
    for lineno, rec in read_jsonl(path):
        try:
            _check_record(rec)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}:{lineno}: malformed QuixBugs record: {e}") from None
        records.append(rec)
    return records


def _check_record(rec):
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    for key in ("name", "buggy_source", "fixed_source"):
        if not isinstance(rec.get(key), str) or not rec[key]:
            raise ValueError(f"field {key!r} must be a non-empty string")
    if not rec["name"].isidentifier():
        raise ValueError(f"name {rec['name']!r} is not an identifier")
    tests = rec.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("field 'tests' must be a non-empty list")
    for t in tests:
        if not isinstance(t, dict) or not isinstance(t.get("args"), list) or "expected" not in t:
            raise ValueError("each test must be {'args': [...], 'expected': ...}")
    if rec.get("compare") not in COMPARES:
        raise ValueError(f"field 'compare' must be one of {COMPARES}, got {rec.get('compare')!r}")
    slow = rec.get("slow_tests") or []
    if not isinstance(slow, list) or not all(isinstance(i, int) and 0 <= i < len(tests) for i in slow):
        raise ValueError("field 'slow_tests' must list test indices")


def make_tasks(split="train", seed=0, path=DATA_PATH):
    """Tasks of one split: 'train' (24), 'heldout' (7, HELDOUT) or 'all' (31), in file order. seed: unused,
    for the common make_tasks(split, seed) signature (the trainer draws from the list with its own
    generator). Raises ValueError for an unknown split, and what load_quixbugs raises."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}: expected 'train', 'heldout' or 'all'")
    tasks = []
    for rec in load_quixbugs(path):
        if split != "all" and (rec["name"] in HELDOUT) != (split == "heldout"):
            continue
        slow = set(rec.get("slow_tests") or [])
        run_ids = tuple(i for i in range(len(rec["tests"])) if i not in slow)
        tasks.append(QuixTask(id=rec["name"], name=rec["name"], buggy_source=rec["buggy_source"],
                              fixed_source=rec["fixed_source"], tests=tuple(rec["tests"]),
                              compare=rec["compare"], run_ids=run_ids,
                              public_ids=run_ids[:math.ceil(len(run_ids) / 2)]))
    return tasks


# ----------------------------------------------------------------------------- running the tests

# Runs in the sandbox, CFG substituted as a JSON string. One line per case, "<tag> {json}": the random tag keeps
# the program's own output apart and is no secret: _parse_report rejects any line sequence the harness would
# not write. The per-case guard counts CPU time (ITIMER_PROF: a loaded machine does not time out correct cases;
# sleeping meets the wall limit) and raises _CaseTimeout, a BaseException `except Exception` misses; the interval re-arms it.
HARNESS = r'''
import json, signal, sys
CFG = json.loads(%s)
class _CaseTimeout(BaseException):
    pass
_armed = [False]
def _alarm(signum, frame):
    if _armed[0]:
        raise _CaseTimeout()
signal.signal(signal.SIGPROF, _alarm)
def guarded(f):
    _armed[0] = True
    signal.setitimer(signal.ITIMER_PROF, CFG["case_timeout"], 0.05)
    try:
        return f()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        _armed[0] = False
_out, _dumps = sys.stdout, json.dumps
def emit(**kw):
    _out.write("\n" + CFG["tag"] + " " + _dumps(kw) + "\n")
    _out.flush()
def describe(e):
    try:
        return guarded(lambda: "%%s: %%s" %% (type(e).__name__, e))[:300]
    except BaseException:
        return "exception"
class _Sink:
    def write(self, s):
        return len(s)
    def flush(self):
        pass
sys.stdout = _Sink()
ns = {"__name__": CFG["name"]}
try:
    with open(CFG["file"], encoding="utf-8") as f:
        src = f.read()
    guarded(lambda: exec(compile(src, CFG["file"], "exec"), ns))
    fn = ns.get(CFG["name"])
    if not callable(fn):
        raise NameError("the file does not define the function %%s" %% CFG["name"])
except _CaseTimeout:
    emit(load="the module did not finish loading within %%s s of CPU time" %% CFG["case_timeout"])
    raise SystemExit(0)
except BaseException as e:
    emit(load=describe(e))
    raise SystemExit(0)
def case(args):
    v = fn(*args)
    if CFG["compare"] == "list":
        v = list(v)
    r = repr(v)
    return r if len(r) <= CFG["max_repr"] else None
for i, args in CFG["cases"]:
    try:
        r = guarded(lambda: case(args))
    except _CaseTimeout:
        emit(i=i, s="timeout")
        break
    except BaseException as e:
        emit(i=i, s="error", e=describe(e))
        continue
    emit(i=i, s="ok", v=r)
emit(done=True)
'''


def _harness(task, case_timeout_s, tag):
    cfg = dict(name=task.name, file=task.name + ".py", compare=task.compare, tag=tag,
               case_timeout=case_timeout_s, max_repr=MAX_REPR_CHARS,
               cases=[[i, task.tests[i]["args"]] for i in task.run_ids])
    return HARNESS % repr(json.dumps(cfg))


def _judge(task, i, got_repr):
    """Compare what the child printed for case i with the expected value, here in the parent.
    got_repr: repr text (untrusted) or None (too long). Returns True/False, never raises."""
    if not isinstance(got_repr, str):
        return False
    try:
        got = ast.literal_eval(parse_ast(got_repr.lstrip(" \t"), mode="eval"))  # literals only: nothing runs
        expected, args = task.tests[i]["expected"], task.tests[i]["args"]
        if task.compare == "list_of_tuples":
            expected = [tuple(x) for x in expected]
        if task.compare == "approx_abs_last_arg":
            return (type(got) in (int, float) and type(expected) in (int, float)
                    and abs(got - expected) <= args[-1])
        return bool(got == expected)
    except Exception:  # unparsable, too deep, a comparison that fails: a wrong answer
        return False


FORGED = "the test process wrote result records the harness did not (forged, duplicate or out of order)"


def _parse_report(task, stdout, tag):
    """The child's tagged lines -> (load_error or None, {case index: record}, done flag), or None if they
    are not exactly a sequence the harness writes: one load record alone, or case records for a prefix of
    task.run_ids in order (a timeout only last), then at most one done record. The program can write such
    lines itself: one it adds invalidates the sequence, one written instead of the harness's counts only
    with the expected value, which the child never sees. An unfinished last line (killed mid-write) is dropped."""
    load, cases, done, stopped = None, {}, False, False
    recs = [line[len(tag):] for line in stdout.split("\n")[:-1] if line.startswith(tag)]
    for n, text in enumerate(recs):
        try:
            rec = json.loads(text) if text.startswith(" ") else None
        except ValueError:
            return None
        if not isinstance(rec, dict) or done:
            return None
        if n == 0 and len(recs) == 1 and set(rec) == {"load"} and isinstance(rec["load"], str):
            load = rec["load"][:300]
        elif rec == {"done": True} and (stopped or len(cases) == len(task.run_ids)):
            done = True
        elif (not stopped and len(cases) < len(task.run_ids) and type(rec.get("i")) is int
              and rec["i"] == task.run_ids[len(cases)] and rec.get("s") in ("ok", "error", "timeout")):
            cases[rec["i"]] = rec
            stopped = rec["s"] == "timeout"
        else:
            return None
    return load, cases, done


_CACHE = OrderedDict()
_CACHE_LOCK = threading.Lock()
CACHE_SIZE = 4096

# CPython 3.11 keeps the AST builder's recursion counter per interpreter: two threads building ASTs at once
# raise "SystemError: AST constructor recursion depth mismatch", so every AST here is built under one lock.
_AST_LOCK = threading.Lock()


def parse_ast(source, mode="exec"):
    """ast.parse(source, mode=mode) under a process-wide lock; raises what ast.parse raises."""
    with _AST_LOCK:
        return ast.parse(source, mode=mode)


def run_tests(task, source, case_timeout_s=4.0, total_timeout_s=20.0):
    """Run task's runnable cases against `source` (str) in one sandbox process: case_timeout_s CPU seconds
    per case, total_timeout_s wall seconds in all. Returns a dict (cached by program, source and limits:
    do not mutate): load_error (str or None: the program did not compile / import / define the function,
    or FORGED, which scores every case not_run); cases ({index in task.run_ids: dict(status, got, error)},
    status 'pass', 'wrong', 'error', 'timeout' or 'not_run' (after a timeout or a crash)); passed, total
    (int); sandbox (its killed_reason); wall_s (float). Never raises for anything the program does."""
    key = hashlib.sha256(repr((task.name, task.compare, task.run_ids, source, case_timeout_s,
                               total_timeout_s)).encode()).hexdigest()
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    tag = "@@qb-" + secrets.token_hex(8)
    res = sandbox.run_python(_harness(task, case_timeout_s, tag), timeout_s=total_timeout_s,
                             max_output_bytes=1 << 20, files={task.name + ".py": source})
    load, recs, done = _parse_report(task, res["stdout"], tag) or (FORGED, {}, False)
    cases, stopped = {}, False
    for i in task.run_ids:
        rec = recs.get(i)
        if rec is None or stopped:
            # the first case without a record is the one that was running when the process died
            status = "not_run" if (stopped or done or load) else \
                "timeout" if res["killed_reason"] == "timeout" else "error"
            why = res["killed_reason"] or f"exit {res['returncode']}"
            err = f"the test process died ({why})" if status == "error" else None
            cases[i] = dict(status=status, got=None, error=err)
            stopped = True
            continue
        if rec["s"] == "ok":
            ok = _judge(task, i, rec.get("v"))
            got = rec.get("v") if isinstance(rec.get("v"), str) else "<a value too long to show>"
            cases[i] = dict(status="pass" if ok else "wrong", got=got, error=None)
        elif rec["s"] == "error":
            cases[i] = dict(status="error", got=None, error=str(rec.get("e"))[:300])
        else:
            cases[i] = dict(status="timeout", got=None, error=None)
            stopped = True
    if load:
        cases = {i: dict(status="not_run", got=None, error=None) for i in task.run_ids}
    out = dict(load_error=load, cases=cases, passed=sum(c["status"] == "pass" for c in cases.values()),
               total=len(cases), sandbox=res["killed_reason"], wall_s=res["wall_s"])
    with _CACHE_LOCK:
        _CACHE[key] = out
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return out


def _short(text, n=SHOW_CHARS):
    return text if len(text) <= n else text[:n] + "..."


def summarize_tests(task, result, ids, case_timeout_s):
    """Human-readable summary of run_tests' result restricted to test indices `ids`: counts and the
    first failure (call, what happened, expected value)."""
    if result["load_error"]:
        return f"the program does not load: {result['load_error']}"
    cs = [(i, result["cases"][i]) for i in ids]
    n_pass = sum(c["status"] == "pass" for _, c in cs)
    lines = [f"{n_pass} of {len(cs)} tests passed"]
    failed = [(i, c) for i, c in cs if c["status"] in ("wrong", "error", "timeout")]   # not_run is no failure
    if failed:
        i, c = failed[0]
        call = _short(f"{task.name}({', '.join(repr(a) for a in task.tests[i]['args'])})")
        exp = _short(repr(task.tests[i]["expected"]))
        if c["status"] == "wrong":
            lines.append(f"first failure: {call} returned {_short(c['got'])}, expected {exp}")
        elif c["status"] == "error":
            lines.append(f"first failure: {call} raised {c['error']}")
        else:
            lines.append(f"first failure: {call} did not return within {case_timeout_s:g} s of CPU time "
                         f"(infinite loop?); later tests were not run")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tool calls

TOOLS = ("read", "edit", "test", "submit")
CUT_ERROR = "error: the turn reached the response length limit before it ended; its tool call was not run"


def tool_schemas():
    """OpenAI-style function schemas of the four tools, for tokenizer.apply_chat_template(tools=...)."""
    def fn(name, desc, props=None, required=()):
        return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": props or {}, "required": list(required)}}}
    return [
        fn("read", "Show the program file with line numbers (the numbers are not part of the file)."),
        fn("edit", "Replace the exact text `old`, which must occur exactly once in the file, by `new`.",
           {"old": {"type": "string",
                    "description": "text copied exactly from the file, without line numbers"},
            "new": {"type": "string", "description": "the replacement text"}}, ("old", "new")),
        fn("test", "Run the public tests on the current file; shows how many pass and the first failure."),
        fn("submit", "Finish: the file is scored on all tests, public and hidden."),
    ]


def format_tool_call(name, arguments=None):
    """The text of one Qwen-style tool call, as a policy would write it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments or {}}) + "\n</tool_call>"


def parse_tool_call(text):
    """Parse the first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in a policy turn (the
    closing tag may be missing: generation may stop on the end-of-turn token; `arguments` may be a JSON
    string). Returns (name, args dict) or an error string starting with 'error:'. Never raises."""
    try:
        return _parse_tool_call(text)
    except Exception as e:  # e.g. RecursionError on absurdly nested JSON
        return f"error: could not parse the tool call ({type(e).__name__})"


_JSON = json.JSONDecoder(strict=False)  # strict=False: raw newlines inside strings are fine


def _parse_tool_call(text):
    if not isinstance(text, str):
        return "error: the turn is not text"
    start = text.find("<tool_call>")
    if start < 0:
        return 'error: no tool call found; write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    body = text[start + len("<tool_call>"):].lstrip()
    if body.startswith("```"):  # a fenced block inside the tags
        body = body[3:]
        body = (body[4:] if body.startswith("json") else body).lstrip()
    try:
        # decode one JSON value and ignore what follows it (the closing tag, a fence, <|im_end|>):
        # cutting at the first "</tool_call>" would break a call whose strings contain that text
        call, _ = _JSON.raw_decode(body)
    except ValueError:
        return "error: the tool call is not valid JSON"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'error: the tool call must be a JSON object with a "name"'
    name, args = call["name"], call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args, strict=False) if args.strip() else {}
        except ValueError:
            return "error: the tool call's arguments are not valid JSON"
    if args is None:
        args = {}
    if name not in TOOLS:
        return f"error: unknown tool {_short(name, 40)!r}; the tools are {', '.join(TOOLS)}"
    if not isinstance(args, dict):
        return "error: the tool call's arguments must be a JSON object"
    if name != "edit":
        return name, {}
    if not isinstance(args.get("old"), str) or not isinstance(args.get("new"), str):
        return 'error: edit needs string arguments "old" and "new"'
    if not args["old"]:
        return 'error: edit needs a non-empty "old"'
    return name, {"old": args["old"], "new": args["new"]}


# ----------------------------------------------------------------------------- the environment

def numbered(source):
    """The source with right-aligned line numbers: '  3 | code'."""
    lines = source.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return "\n".join(f"{i:3d} | {line}" for i, line in enumerate(lines, 1))


class QuixBugsEnv:
    """One episode on one QuixBugs program. `step` never raises on model output: a malformed call, an unknown
    tool, bad arguments or a turn cut at the response limit (finish='length', never run) give an 'error: ...'
    observation, count in info['n_invalid'] and use a turn; a failed edit (text absent or ambiguous) counts
    in info['n_failed_edits']. max_turns: the env's own budget (None: the rollout's limit only); reaching it
    ends the episode with stop='budget' and reward 0."""

    def __init__(self, case_timeout_s=4.0, total_timeout_s=20.0, max_turns=None):
        self.case_timeout_s, self.total_timeout_s, self.max_turns = case_timeout_s, total_timeout_s, max_turns
        self.task = None

    def reset(self, task):
        """Start an episode on `task` (a QuixTask); returns the prompt text (the issue statement)."""
        self.task, self.source, self.done = task, task.buggy_source, False
        self.n_turns = self.n_invalid = self.n_edits = self.n_failed_edits = self.n_tests = 0
        return (f"The Python program `{task.name}.py` has a bug: it fails some of its tests. The docstring "
                f"at the end of the file says what `{task.name}` must do. Fix the bug with the tools: "
                f"`read` shows the file with line numbers, `edit` replaces an exact piece of text `old` "
                f"(copied from the file without the line numbers, occurring exactly once) by `new`, "
                f"`test` runs the public tests, and `submit` ends the episode: the program is then "
                f"scored on all tests, public and hidden (reward 1 if all pass, else 0). "
                f"Call one tool per turn.")

    def _info(self, **extra):
        return dict(n_turns=self.n_turns, n_invalid=self.n_invalid, n_edits=self.n_edits,
                    n_failed_edits=self.n_failed_edits, n_tests=self.n_tests, **extra)

    def step(self, action_text, finish="stop"):
        """One policy turn (its decoded text) -> (observation str, reward float, done bool, info dict).
        finish: 'stop' (the turn ended with its stop token) or 'length' (cut at the response limit:
        the call may be incomplete, so it is not run; a malformed call)."""
        if self.task is None or self.done:
            return "error: the episode is over", 0.0, True, self._info(stop="over", success=False)
        self.n_turns += 1
        parsed = parse_tool_call(action_text) if finish != "length" else CUT_ERROR
        if isinstance(parsed, str):
            self.n_invalid += 1
            obs, reward, done, info = parsed, 0.0, False, {}
        else:
            name, args = parsed
            obs, reward, done, info = getattr(self, "_tool_" + name)(**args)
            if isinstance(action_text, str) and action_text.count("<tool_call>") > 1:
                obs += "\n(note: only the first tool call of a turn is run)"
        if not done and self.max_turns is not None and self.n_turns >= self.max_turns:
            done, reward, info = True, 0.0, dict(stop="budget", success=False)
        self.done = done
        return obs, reward, done, self._info(**info)

    def _tool_read(self):
        return numbered(self.source), 0.0, False, {}

    def _tool_edit(self, old, new):
        count = self.source.count(old)
        if count != 1:
            self.n_failed_edits += 1
            why = ("not found in the file" if count == 0
                   else f"found {count} times; include more lines to make it unique")
            return f"error: edit failed: `old` was {why}. Nothing changed.", 0.0, False, {}
        at = self.source.index(old)
        src = self.source[:at] + new + self.source[at + len(old):]
        if len(src) > MAX_SOURCE_CHARS:
            self.n_failed_edits += 1
            return f"error: edit failed: the file would exceed {MAX_SOURCE_CHARS} characters.", 0.0, False, {}
        self.source = src
        self.n_edits += 1
        first = src.count("\n", 0, at) + 1
        last = first + new.count("\n") - (1 if new.endswith("\n") else 0)
        lo, hi = max(1, first - 1), min(src.count("\n") + 1, max(first, last) + 1)  # one line of context
        shown = numbered(src).split("\n")[lo - 1:hi]
        obs = f"edited {self.task.name}.py; lines {lo}-{lo + len(shown) - 1} now read:\n" + "\n".join(shown)
        try:
            parse_ast(src)  # parses only, nothing is executed here
        except Exception as e:
            where = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
            obs += f"\nwarning: the file no longer parses ({type(e).__name__}{where})"
        return obs, 0.0, False, {}

    def _tool_test(self):
        self.n_tests += 1
        res = run_tests(self.task, self.source, self.case_timeout_s, self.total_timeout_s)
        report = summarize_tests(self.task, res, self.task.public_ids, self.case_timeout_s)
        return "public tests: " + report, 0.0, False, {}

    def _tool_submit(self):
        res = run_tests(self.task, self.source, self.case_timeout_s, self.total_timeout_s)
        ok = res["load_error"] is None and res["passed"] == res["total"]
        pub = sum(res["cases"][i]["status"] == "pass" for i in self.task.public_ids)
        obs = f"submitted: {res['passed']} of {res['total']} tests passed"
        return obs, float(ok), True, dict(stop="submit", success=ok, passed=res["passed"], total=res["total"],
                                          pass_frac=res["passed"] / max(1, res["total"]),
                                          public_passed=pub, public_total=len(self.task.public_ids))


# ----------------------------------------------------------------------------- scripted policies

def _split_docstring(source):
    """(code lines, trailing-docstring lines) of a trusted source, split at a final bare string."""
    lines = source.split("\n")
    body = parse_ast(source).body
    last = body[-1] if body else None
    if isinstance(last, ast.Expr) and isinstance(getattr(last.value, "value", None), str):
        return lines[:last.lineno - 1], lines[last.lineno - 1:]
    return lines, []


def reference_edits(task):
    """The reference fix as `edit` arguments: [{'old': ..., 'new': ...}], computed from a line diff
    of the code parts (trailing docstrings left alone) of the buggy and fixed sources. Each `old`
    occurs exactly once in the source at the time it is applied, in list order."""
    a, _ = _split_docstring(task.buggy_source)
    b, _ = _split_docstring(task.fixed_source)
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    hunks = [op for op in ops if op[0] != "equal"]
    # leading / trailing blank-line differences do not matter to Python: drop those hunks
    hunks = [h for h in hunks if any(s.strip() for s in a[h[1]:h[2]] + b[h[3]:h[4]])]
    edits, source = [], task.buggy_source
    for _, i1, i2, j1, j2 in reversed(hunks):  # bottom-up, so earlier line numbers stay valid
        ctx = 1
        while True:
            lo, hi = max(0, i1 - ctx), min(len(a), i2 + ctx)
            old = "\n".join(a[lo:hi])
            new = "\n".join(a[lo:i1] + b[j1:j2] + a[i2:hi])
            if source.count(old) == 1 or (lo == 0 and hi == len(a)):
                break
            ctx += 1
        edits.append({"old": old, "new": new})
        source = source.replace(old, new, 1)
    return edits


def scripted_actions(task, policy="oracle"):
    """Tool-call turns of a scripted policy: 'oracle' (read, the reference edits, test, submit) or
    'blind' (read, test, submit without editing). Raises ValueError for another policy."""
    if policy not in ("oracle", "blind"):
        raise ValueError(f"unknown scripted policy {policy!r}")
    edits = reference_edits(task) if policy == "oracle" else []
    return ([format_tool_call("read")] + [format_tool_call("edit", e) for e in edits]
            + [format_tool_call("test"), format_tool_call("submit")])


# ----------------------------------------------------------------------------- the gym contract (gym.py)

def setup(cfg, vocab=None):
    """The 24 training programs and the 7 held-out ones (gym.load_gym keeps the first eval_tasks); the four tools'
    schemas in the system turn of the policy's chat template. The warm start imitates the oracle
    (scripted_actions) on training programs: it teaches the tool calls, and fixes of programs never evaluated."""
    tok = hf.load_tokenizer(cfg["model"], cfg["gguf_file"], cfg["chat_template"])
    return dict(tok=tok, fmt=hf.chat_format(tok, tools=tool_schemas(), enable_thinking=cfg["enable_thinking"]),
                train_tasks=make_tasks("train"), eval_tasks=make_tasks("heldout"),
                make_env=lambda: QuixBugsEnv(max_turns=cfg["max_turns"]), baselines={},
                warm_policy=lambda rng: oracle_turn, answer_text=None)


def oracle_turn(ep):
    """The oracle's next tool call in a rollout episode (rollout.py's scripted policy); past the end of
    its script (a turn cut at max_response_tokens does not end the episode) it submits again."""
    actions = scripted_actions(ep.task)
    return actions[min(len(ep.actions), len(actions) - 1)]
