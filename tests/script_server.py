"""Run the repo's scripts (python train.py ..., python sample.py ...) as child processes of one
pre-warmed interpreter instead of a fresh `python` each time.

A fresh interpreter spends about 2 s (more on a busy 2-core machine) importing torch, transformers and
the repo's modules before train.py reads its first flag; the tests start train.py and sample.py about
a hundred times, mostly for one-line refusals. The server imports them once; each run is a fork of it
that gets its own stdin (/dev/null), stdout and stderr (files), working directory, environment and
sys.argv, and runs the script as __main__ (runpy), so exit status, stdout and stderr are the script's own,
as with subprocess.run. The server only imports modules (torch, the repo's, and torch._dynamo,
transformers and matplotlib, which a run imports lazily): it runs no torch op and no tokenizer, so no
thread pool exists to fork, and it fills no cache of the repo's code.

run_script(...) returns a subprocess.CompletedProcess, like subprocess.run(..., capture_output=True,
text=True). NANOAGENT_TEST_FRESH_PYTHON=1 runs every script in a fresh interpreter instead.
"""
import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVER = r'''
import json, os, runpy, sys
sys.path.insert(0, os.getcwd())
import torch  # noqa: F401  the expensive imports, once
import train, sample  # noqa: F401
import torch._dynamo, transformers, matplotlib.figure  # noqa: F401  imported lazily (first optimizer, HF model, curves)
reply = os.fdopen(os.dup(1), 'w')
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the server's own prints go nowhere
reply.write('ready\n')
reply.flush()
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid:
        reply.write(f'{pid}\n')
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(f'{os.waitstatus_to_exitcode(status)}\n')
        reply.flush()
        continue
    # the child: a process of its own, as `python script args` would be
    os.setsid()
    reply.close()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(req['stdout'], os.O_WRONLY | os.O_TRUNC), 1)
    os.dup2(os.open(req['stderr'], os.O_WRONLY | os.O_TRUNC), 2)
    os.chdir(req['cwd'])
    os.environ.clear()
    os.environ.update(req['env'])
    sys.argv = [req['script'], *req['args']]
    sys.path[0] = os.path.dirname(os.path.abspath(req['script']))
    try:
        runpy.run_path(req['script'], run_name='__main__')
    except SystemExit:
        raise
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)
'''

_lock = threading.Lock()
_server = None


def _start():
    global _server
    p = subprocess.Popen([sys.executable, '-c', SERVER], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, HF_HUB_OFFLINE='1'))
    if p.stdout.readline() != 'ready\n':
        raise RuntimeError('script_server: the server did not start')
    atexit.register(p.kill)
    _server = p


def _readline(timeout):
    f = _server.stdout
    if not select.select([f], [], [], timeout)[0]:
        return None
    return f.readline()


def run_script(script, args, cwd=ROOT, env=None, timeout=600):
    """subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), from the pre-warmed server."""
    env = dict(os.environ if env is None else env)
    if os.environ.get('NANOAGENT_TEST_FRESH_PYTHON'):
        return subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    with _lock:
        if _server is None or _server.poll() is not None:
            _start()
        with tempfile.TemporaryDirectory() as d:
            out, err = os.path.join(d, 'stdout'), os.path.join(d, 'stderr')
            open(out, 'w').close(), open(err, 'w').close()
            _server.stdin.write(json.dumps(dict(script=script, args=[str(a) for a in args], cwd=str(cwd), env=env,
                                                stdout=out, stderr=err)) + '\n')
            _server.stdin.flush()
            pid = int(_server.stdout.readline())
            code = _readline(timeout)
            if code is None:
                os.killpg(pid, signal.SIGKILL)
                _readline(30)
                raise subprocess.TimeoutExpired([script, *args], timeout)
            with open(out) as fo, open(err) as fe:
                return subprocess.CompletedProcess([sys.executable, script, *args], int(code), fo.read(), fe.read())
