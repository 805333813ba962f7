"""A tested program that forges the QuixBugs harness's result records, or reads the hidden expected
values through /proc/<parent pid>/cwd, scores 0: with every sandbox layer, with Landlock off, and with
every kernel layer off (the audit hook alone)."""

import os
import secrets

import pytest

from gyms import quixbugs as G
from gyms import sandbox

TASK = {t.name: t for t in G.make_tasks("all")}["bitcount"]

# walks its stack frames to the harness's globals (the random tag, emit) and writes an `ok` record
# with the right value for case 0 before the function raises
FORGE_CASE0 = '''import sys
def _harness():
    f = sys._getframe()
    while f is not None and "emit" not in f.f_globals:
        f = f.f_back
    return f.f_globals
def bitcount(n):
    g = _harness()
    i, args = g["CFG"]["cases"][0]
    if [n] == args:
        g["emit"](i=i, s="ok", v=repr(bin(n).count("1")))
    raise ValueError("never returns")
'''

# at import: reads the hidden expected values (through the parent's cwd, or any other path it can
# find), writes an `ok` record with the expected value for every case and `done`, then exits before
# the harness runs anything; the function itself raises on every call
STEAL = '''import json, os, sys
def bitcount(n):
    raise ValueError("never returns")
f = sys._getframe()
while f is not None and "emit" not in f.f_globals:
    f = f.f_back
g = f.f_globals
tests = None
pp = os.getppid()
for p in ("/proc/%%d/cwd/data/quixbugs.jsonl" %% pp, "/proc/%%d/root%%s" %% (pp, %(data)r), %(data)r):
    try:
        with open(p) as fh:
            tests = [r for r in map(json.loads, fh) if r["name"] == "bitcount"][0]["tests"]
        break
    except Exception:
        pass
if tests is not None:
    for i, _ in g["CFG"]["cases"]:
        g["emit"](i=i, s="ok", v=repr(tests[i]["expected"]))
    g["emit"](done=True)
    os._exit(0)
''' % dict(data=G.DATA_PATH)

SETTINGS = {"all layers": dict(), "no Landlock": dict(LANDLOCK=False),
            "no kernel layers": dict(KERNEL_LAYERS=False)}


def fresh(source):
    """The source with a random comment, so that no cached result from another setting is reused."""
    return source + f"# {secrets.token_hex(8)}\n"


def layers():
    res = sandbox.run_python("import sys; print(','.join(sys._sandbox_layers))")
    return res["stdout"].strip().split(",")


@pytest.fixture(params=list(SETTINGS), ids=list(SETTINGS))
def setting(request, monkeypatch):
    for k, v in SETTINGS[request.param].items():
        monkeypatch.setattr(sandbox, k, v, raising=False)
    return request.param


def submit(source):
    env = G.QuixBugsEnv()
    env.reset(TASK)
    env.source = source
    return env.step(G.format_tool_call("submit"))[1]


def test_forged_record_for_case0_scores_0(setting):
    res = G.run_tests(TASK, fresh(FORGE_CASE0))
    assert res["passed"] == 0 and res["load_error"] == G.FORGED, res
    assert all(c["status"] != "pass" for c in res["cases"].values())


def test_reading_expected_values_through_proc_scores_0(setting):
    if setting == "no Landlock":
        assert not any(x.startswith("landlock") for x in layers())
    res = G.run_tests(TASK, fresh(STEAL))
    assert res["passed"] == 0, res
    assert submit(fresh(STEAL)) == 0.0


def test_the_fixed_program_still_scores_1(setting):
    res = G.run_tests(TASK, fresh(TASK.fixed_source))
    assert res["load_error"] is None and res["passed"] == res["total"]
    assert submit(fresh(TASK.fixed_source)) == 1.0


@pytest.mark.parametrize("extra", [
    '{"i": %(i0)d, "s": "ok", "v": "0"}',            # a second record for case 0
    '{"i": 999, "s": "ok", "v": "0"}',               # an unknown case
    '{"done": true}',                                # a second done
    '{"load": "x"}',                                 # a load record after case records
    'not json',
])
def test_any_record_beyond_the_harness_sequence_invalidates_the_run(extra):
    tag = "@@qb-" + "0" * 16
    good = "".join(f'\n{tag} {{"i": {i}, "s": "ok", "v": "1"}}\n' for i in TASK.run_ids)
    good += f'\n{tag} {{"done": true}}\n'
    assert G._parse_report(TASK, good, tag)[2] is True
    line = f"\n{tag} " + (extra % dict(i0=TASK.run_ids[0]) if "%" in extra else extra) + "\n"
    assert G._parse_report(TASK, good + line, tag) is None
    assert G._parse_report(TASK, line + good, tag) is None
    cut = good[:-10]  # the last line unfinished (killed mid-write): dropped, the prefix stays valid
    assert G._parse_report(TASK, cut, tag)[2] is False


def test_the_kernel_hides_the_data_without_landlock(monkeypatch):
    """mountns alone (no Landlock, no audit hook): the data, .git and the parent's /proc entries."""
    monkeypatch.setattr(sandbox, "LANDLOCK", False, raising=False)
    if "mountns" not in layers():
        pytest.skip("no user + mount namespaces here: only the audit hook hides the data")
    pp = os.getpid()
    for path in (G.DATA_PATH, f"/proc/{pp}/cwd/data/quixbugs.jsonl", f"/proc/{pp}/root{G.DATA_PATH}",
                 f"/proc/{pp}/mem", f"/proc/{pp}/environ", os.path.join(sandbox._REPO, ".git", "HEAD")):
        res = sandbox.run_python(f"print(len(open({path!r}, 'rb').read(100)))", audit_hook=False)
        assert res["returncode"] == 1 and "PermissionError" in res["stderr"], (path, res)
    res = sandbox.run_python("open('x', 'w').write('ok'); print(open('x').read())", audit_hook=False)
    assert res["stdout"] == "ok\n", res  # the working directory still works


def test_the_audit_hook_refuses_proc_and_hidden_reads(monkeypatch):
    """The audit hook alone (every kernel layer off): the same paths, with its own message."""
    monkeypatch.setattr(sandbox, "KERNEL_LAYERS", False)
    pp = os.getpid()
    for path in (G.DATA_PATH, f"/proc/{pp}/cwd/data/quixbugs.jsonl", "/proc/self/environ",
                 f"/proc/{pp}/mem", os.path.join(sandbox._REPO, "data", "..", "data", "quixbugs.jsonl")):
        res = sandbox.run_python(f"print(len(open({path!r}, 'rb').read(100)))")
        assert res["returncode"] == 1 and "PermissionError: sandbox: reading" in res["stderr"], (path, res)
