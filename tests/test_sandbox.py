"""gyms/sandbox.py: normal runs, then hostile programs. Every hostile test first proves its limit on a
harmless version (bounded, with a deadline) before the real thing, so a broken limit cannot take the
shared machine down."""

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from gyms import sandbox

LAYERS = sandbox.sandbox_layers()
KERNEL_FS = any(x.startswith("landlock") for x in LAYERS)   # kernel-enforced file access
KERNEL_PROC = "seccomp" in LAYERS or os.getuid() != 0        # kernel-enforced no-fork


def run(code, **kw):
    return sandbox.run_python(code, **kw)


def test_layers_probe():
    assert "rlimits" in LAYERS and "audit" in LAYERS
    print("active sandbox layers:", LAYERS)


def test_basic_run_and_cleanup():
    res = run("import os, sys\nprint('hi')\nprint(os.getcwd())\nprint('err', file=sys.stderr)")
    assert res["returncode"] == 0 and res["killed_reason"] is None
    assert not res["timed_out"] and not res["output_truncated"]
    out = res["stdout"].split("\n")
    assert out[0] == "hi" and res["stderr"] == "err\n"
    assert os.path.basename(out[1]).startswith("nanoagent_sb_")
    assert not os.path.exists(out[1]), "the temporary working directory must be deleted"
    assert 0 < res["wall_s"] < 5


def test_exit_codes_tracebacks_and_files():
    assert run("import sys; sys.exit(3)")["returncode"] == 3
    res = run("x = 1\n1 / 0\n")
    assert res["returncode"] == 1 and 'File "main.py", line 2' in res["stderr"]
    assert "ZeroDivisionError" in res["stderr"] and res["killed_reason"] is None
    res = run("import helper; print(helper.X)", files={"helper.py": "X = 41 + 1"})
    assert res["returncode"] == 1  # -I: the script directory is not on sys.path ...
    res = run("print(open('helper.txt').read())", files={"helper.txt": "data"})
    assert res["stdout"] == "data\n"  # ... but the files are there
    for bad in ("../x.py", "/tmp/x.py", "a/b.py", ""):
        with pytest.raises(ValueError):
            run("pass", files={bad: ""})


def test_scrubbed_environment_and_isolated_interpreter(monkeypatch):
    monkeypatch.setenv("NANOAGENT_SECRET_TOKEN", "do-not-leak")
    res = run("import os; print(sorted(os.environ))")
    assert set(eval(res["stdout"])) <= {"PATH", "LANG", "HOME", "TMPDIR", "LC_CTYPE"}
    res = run("import torch")  # no site-packages under -S
    assert res["returncode"] == 1 and "ModuleNotFoundError" in res["stderr"]
    res = run("import json, heapq, collections, string, math; print(json.dumps(sorted(set('cba'))))")
    assert res["stdout"] == '["a", "b", "c"]\n'


def test_sleep_forever_is_stopped_by_the_wall_limit():
    res = run("import time\nprint('start', flush=True)\ntime.sleep(10**6)", timeout_s=1.0)
    assert res["timed_out"] and res["killed_reason"] == "timeout"
    assert res["returncode"] == -signal.SIGKILL and res["stdout"] == "start\n"
    assert res["wall_s"] < 3


def test_busy_loop_is_stopped_by_the_cpu_limit():
    res = run("while True:\n    pass", timeout_s=10.0, cpu_s=1)
    assert res["killed_reason"] == "cpu" and not res["timed_out"]
    assert res["wall_s"] < 6


def test_memory_limit():
    # harmless first: 200 MB under a 64 MB limit
    res = run("x = bytearray(200 * 2**20)", memory_mb=64)
    assert res["killed_reason"] == "memory" and "MemoryError" in res["stderr"]
    # the real thing: 8 GB under the default 1 GB
    res = run("x = bytearray(8 * 2**30)\nprint('allocated')", timeout_s=5.0)
    assert res["killed_reason"] == "memory" and "allocated" not in res["stdout"]
    assert res["wall_s"] < 5
    # and a list that grows until it hits the limit
    res = run("x = []\nwhile True:\n    x.append(' ' * 2**20)", timeout_s=10.0, memory_mb=256)
    assert res["killed_reason"] == "memory" and res["wall_s"] < 10


def test_output_flood_is_cut():
    res = run("print('x' * 1000)", max_output_bytes=100)  # harmless first
    assert res["output_truncated"] and res["killed_reason"] == "output" and len(res["stdout"]) == 100
    res = run("import sys\nsys.stdout.write('y' * 100 * 2**20)", timeout_s=10.0)  # 100 MB at once
    assert res["output_truncated"] and res["killed_reason"] == "output"
    assert len(res["stdout"]) <= 65536 and res["wall_s"] < 10
    res = run("while True:\n    print('z' * 1000)", timeout_s=10.0)  # and as a stream
    assert res["output_truncated"] and len(res["stdout"]) + len(res["stderr"]) <= 65536


# A fork bomb that cannot explode even if every guard failed: at most 20 forks in 2 s, and every
# child exits at once. It prints how many forks succeeded.
BOUNDED_FORKS = """
import os, time
t, forked = time.time(), 0
for _ in range(20):
    if time.time() - t > 2:
        break
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        os._exit(0)
    forked += 1
    os.waitpid(pid, 0)
print(forked)
"""
FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


@pytest.mark.parametrize("audit", [True, False])
def test_fork_bomb(audit):
    if not audit and not KERNEL_PROC:
        pytest.skip("no kernel-level process guard here (root without seccomp)")
    res = run(BOUNDED_FORKS, audit_hook=audit, timeout_s=5.0)
    assert res["stdout"] == "0\n", res  # proven harmless: no fork succeeds
    res = run(FORK_BOMB, audit_hook=audit, timeout_s=1.0)
    assert res["killed_reason"] == "timeout" and res["wall_s"] < 3
    res = run("import subprocess; subprocess.run(['/bin/true'])", audit_hook=audit)
    assert res["returncode"] == 1 and "PermissionError" in res["stderr"]


ESCAPES = [
    "open({p!r}, 'w').write('x')",
    "import os; os.close(os.open({p!r}, os.O_CREAT | os.O_WRONLY))",
    "import pathlib; pathlib.Path({p!r}).write_text('x')",
    "import shutil; open('a', 'w').write('x'); shutil.copy('a', {p!r})",
    "import os; open('a', 'w').write('x'); os.rename('a', {p!r})",
    "import os; open('../' + os.path.basename({p!r}), 'w')",  # the temp dir's parent is /tmp
    "import os; os.symlink({p!r}, 'link'); open('link', 'w').write('x')",
]


@pytest.mark.parametrize("audit", [True, False])
def test_writes_outside_the_working_directory_are_refused(audit):
    if not audit and not KERNEL_FS:
        pytest.skip("no Landlock here: only the audit hook guards writes")
    for code in ESCAPES:
        path = f"/tmp/nanoagent_escape_{secrets.token_hex(8)}"
        try:
            res = run(code.format(p=path), audit_hook=audit)
            assert not os.path.lexists(path), (code, res)
            assert res["returncode"] == 1 and "PermissionError" in res["stderr"], (code, res)
        finally:
            if os.path.lexists(path):
                os.remove(path)
    res = run("open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())", audit_hook=audit)
    assert res["stdout"] == "ok\n"  # writing inside the working directory is fine


def test_file_size_and_count_limits():
    res = run(f"open('big', 'wb').write(b'x' * ({sandbox.FILE_SIZE_MB} + 1) * 2**20)")
    assert res["returncode"] == 1 and "File too large" in res["stderr"]
    res = run(f"for i in range({sandbox.MAX_CREATED_FILES} + 1):\n    open(f'f{{i}}', 'w').close()")
    assert res["returncode"] == 1 and "too many files" in res["stderr"]


@pytest.mark.skipif(not KERNEL_FS, reason="reads are only restricted with Landlock")
def test_reads_outside_are_refused_with_landlock():
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "quixbugs.jsonl")
    for audit in (True, False):
        res = run(f"print(len(open({data!r}).read()))", audit_hook=audit)
        assert res["returncode"] == 1 and "PermissionError" in res["stderr"]


@pytest.mark.parametrize("audit", [True, False])
def test_no_network(audit):
    if not audit and "seccomp" not in LAYERS:
        pytest.skip("no seccomp here: only the audit hook refuses sockets")
    res = run("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
              "s.sendto(b'x', ('127.0.0.1', 9))", audit_hook=audit)
    assert res["returncode"] == 1 and "PermissionError" in res["stderr"]


@pytest.mark.parametrize("audit", [True, False])
def test_cannot_signal_other_processes(audit):
    if not audit and not any(x.startswith("landlock") and int(x[8:]) >= 6 for x in LAYERS):
        pytest.skip("no Landlock signal scoping here: only the audit hook refuses os.kill")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        res = run(f"import os, signal; os.kill({victim.pid}, signal.SIGKILL)", audit_hook=audit)
        assert res["returncode"] == 1 and "PermissionError" in res["stderr"]
        time.sleep(0.1)
        assert victim.poll() is None, "the sandbox killed a process outside it"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.skipif("nocaps" not in LAYERS, reason="capabilities not dropped here")
def test_no_privileges_left():
    res = run("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (10**6, 10**6))",
              audit_hook=False)
    assert res["returncode"] == 1 and "not allowed to raise maximum limit" in res["stderr"]
    res = run("import os; os.mknod('dev', 0o600 | 0o060000, os.makedev(8, 0))", audit_hook=False)
    assert res["returncode"] == 1 and "PermissionError" in res["stderr"]


def test_audit_hook_refusals():
    for code in ("import ctypes", "import multiprocessing", "import os; os.chdir('/')",
                 "import resource; resource.setrlimit(resource.RLIMIT_CPU, (1, 1))",
                 "def f(): pass\nf.__code__ = (lambda: 0).__code__"):
        res = run(code)
        assert res["returncode"] == 1 and "PermissionError: sandbox:" in res["stderr"], code


def test_run_many_keeps_order():
    res = sandbox.run_many([f"print({i} * {i})" for i in range(6)], workers=2)
    assert [r["stdout"] for r in res] == [f"{i * i}\n" for i in range(6)]
