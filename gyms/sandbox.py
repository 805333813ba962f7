"""
Run untrusted Python (model-written code, edited programs) in a child process with limits.

    res = run_python("print(1 + 1)", timeout_s=5.0)
    res["stdout"] == "2\n" and res["returncode"] == 0 and res["killed_reason"] is None

What one call does
- A fresh temporary working directory (deleted afterwards, also HOME and TMPDIR of the child); the
  code is written there as `main.py` (plus any `files`), so tracebacks show real line numbers.
- A separate interpreter, `python -I -S`: isolated mode (PYTHON* variables ignored, no user site, the
  script directory not on sys.path) and no `site` (no site-packages: only the standard library can be
  imported; start-up is also ~3x faster). Environment: PATH, LANG, HOME, TMPDIR only. stdin /dev/null.
- Its own session / process group; on timeout, on output overflow and after every run the whole
  group gets SIGKILL. Wall-clock limit `timeout_s`, enforced by the parent.
- stdout and stderr are read incrementally; past `max_output_bytes` (both together) the child is
  killed and `output_truncated` is set. Decoded as UTF-8 with replacement characters.
- Stage 1 (trusted code, `STAGE1`) runs first in the child and then exec()s a fresh interpreter for
  stage 2, so nothing it loaded (ctypes) is reachable from the untrusted code. Stage 1 applies:
    rlimits   (kernel) RLIMIT_CPU cpu_s seconds (default ceil(timeout_s) + 1), RLIMIT_AS memory_mb
              (big allocations raise MemoryError), RLIMIT_FSIZE FILE_SIZE_MB per file, RLIMIT_NOFILE,
              RLIMIT_CORE 0, RLIMIT_NPROC 0 (no fork / threads; the kernel never applies it to uid 0)
    mountns   (kernel, unprivileged user namespaces or root) a new user and mount namespace: an empty
              tmpfs covers each of HIDDEN_DIRS (the repo's data/ and .git/), and /proc/<pid>/root, cwd,
              fd, mem, environ of every process outside the sandbox are refused (ptrace access check)
    nocaps    (kernel) no_new_privs, an empty capability bounding set and empty capability sets: a
              root child keeps uid 0 but loses every privilege (no mknod, mount, raw devices,
              DAC override, raising hard rlimits, ...)
    seccomp   (kernel, x86_64 / aarch64) fork, vfork, clone of a new process (threads are allowed),
              socket, socketpair, io_uring, ptrace, unshare, setns, mknod, mount fail with EPERM:
              no fork bomb and no network, also for root
    landlock  (kernel >= 5.13 with Landlock enabled) writes, creations, deletions only inside the
              working directory; reads and exec only of the Python installation, /usr, /lib*,
              /dev/null, /dev/urandom and the working directory (so not the training data or the
              hidden tests); TCP bind/connect refused (ABI >= 4); signals and abstract unix sockets
              scoped to the sandbox (ABI >= 6)
  A layer the kernel lacks is skipped silently; `sandbox_layers()` lists those that are active.
- Stage 2 installs a PEP 578 audit hook, then runs main.py as __main__. The hook refuses with
  PermissionError: process creation, signals, sockets, changing rlimits, os.chdir, links, imports of
  ctypes / _posixsubprocess / multiprocessing / subinterpreters, replacing a function's __code__, any
  write / create / delete / rename / chmod outside the working directory, more than
  MAX_CREATED_FILES files opened for writing, and opening anything whose real path (symlinks and
  /proc/<pid>/cwd-style links resolved) is in /proc or HIDDEN_DIRS. It gives clear errors and
  covers kernels without seccomp / Landlock, but it is NOT a security boundary (see below).

The hidden tests (HIDDEN_DIRS), by kernel:
- Landlock: nothing outside the read list above can be read, /proc included: a kernel guarantee.
- no Landlock, mountns (the usual case where user namespaces are allowed, or as root): HIDDEN_DIRS
  are empty at their paths and no outside process's /proc links or memory can be opened: a kernel
  guarantee for those directories; another copy elsewhere on the disk (a second checkout, a bind
  mount of them at another path) stays readable.
- neither (old kernel, containers that forbid both): only the audit hook refuses the reads, and code
  that tampers with the interpreter can get past it (see below).
In every case the callers (gyms/quixbugs.py) never send expected values into the child.

What it does NOT protect against
- Without Landlock (old kernel, disabled LSM, some containers): the child can READ every file the
  trainer's user can read (but HIDDEN_DIRS with mountns, see above), and writes outside the
  working directory are refused by the audit hook only. Without seccomp (other architectures):
  process creation and sockets are refused by the audit hook only, and for a root trainer
  RLIMIT_NPROC does not apply. The audit hook runs inside the
  untrusted interpreter; PEP 578 says hooks are not a sandbox (code can reach the hook's globals).
- Root: the child keeps uid 0 (it cannot drop to `nobody` because the interpreter may live under
  /root); with the capability layer it has no privileges left, but files owned by root are still
  "its own" files: only Landlock stops writes to them.
- Denial of service inside the limits: CPU contention with the trainer (bounded by the wall limit),
  up to memory_mb per concurrent run, disk inside the temp dir up to FILE_SIZE_MB x files.
- UDP or other traffic without Landlock and seccomp; covert channels; timing side channels; kernel or
  interpreter exploits. For hostile code use a disposable VM or container without credentials.
Results are data from an untrusted process: parse them defensively (gyms/quixbugs.py does, and it
compares with the expected outputs in the parent, so the child never sees the hidden answers).
"""

import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

FILE_SIZE_MB = 16        # RLIMIT_FSIZE: largest file the child may write
MAX_OPEN_FILES = 64      # RLIMIT_NOFILE
MAX_CREATED_FILES = 64   # files the child may open for writing (audit hook)
KERNEL_LAYERS = True     # False skips mountns / nocaps / seccomp / landlock (a platform where they misbehave)
LANDLOCK = True          # False skips Landlock only (tests check what holds on a kernel without it)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# directories the child must never read: the data (hidden tests) and the git objects that hold it too
HIDDEN_DIRS = (os.path.join(_REPO, "data"), os.path.join(_REPO, ".git"))

# Stage 1: trusted. argv: cpu_s, address-space bytes, file-size bytes, nofile, kernel layers 0/1,
# Landlock 0/1, stage-2 source, hidden directories (real paths, one a line).
# Every kernel layer is best effort: a missing feature is skipped, the list of applied ones is passed
# to stage 2 (readable there as sys._sandbox_layers).
STAGE1 = r'''
import os, sys, resource
cpu, mem, fsize, nofile, kernel, landlock = (int(a) for a in sys.argv[1:7])
hidden = [d for d in sys.argv[8].split("\n") if os.path.isdir(d)]
layers = []
for lim, v in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
               (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_NOFILE, (nofile, nofile)),
               (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_NPROC, (0, 0))):
    try:
        resource.setrlimit(lim, v)
    except (ValueError, OSError):
        pass  # a hard limit already lower than ours stays
layers.append("rlimits")
try:
    if not kernel:
        raise ImportError("kernel layers switched off (sandbox.KERNEL_LAYERS)")
    import ctypes
    C = ctypes.c_ulong
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # mountns: a new user + mount namespace (its full capabilities are dropped below) with an empty
    # read-only tmpfs over each hidden directory; from another user namespace the ptrace access check
    # refuses /proc/<pid>/{root,cwd,fd,mem,environ} of every process outside it
    try:
        uid, gid = os.getuid(), os.getgid()
        if hidden and libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS
            for name, text in (("uid_map", "%d %d 1" % (uid, uid)), ("setgroups", "deny"),
                               ("gid_map", "%d %d 1" % (gid, gid))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
            ok = libc.mount(b"none", b"/", None, C(0x44000), None) == 0  # MS_REC | MS_PRIVATE
            for d in hidden:  # MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
                ok = ok and libc.mount(b"tmpfs", os.fsencode(d), b"tmpfs", C(15), b"size=4k,mode=0") == 0
            if ok:
                layers.append("mountns")
    except OSError:
        pass
    if libc.prctl(38, C(1), C(0), C(0), C(0)) != 0:  # PR_SET_NO_NEW_PRIVS, needed by the next two
        raise OSError("no_new_privs")
    # capabilities: empty bounding set (PR_CAPBSET_DROP, fails harmlessly past the last cap and for
    # non-root), clear ambient, then capset all-zero (header v3, pid 0 = self)
    for cap in range(64):
        libc.prctl(24, C(cap), C(0), C(0), C(0))
    libc.prctl(47, C(4), C(0), C(0), C(0))
    if libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()) == 0:
        layers.append("nocaps")
    # seccomp: a small BPF denylist (see the module docstring)
    arch = {"x86_64": (0xC000003E, 56, 435, (57, 58, 41, 53, 425, 101, 272, 308, 133, 259, 165)),
            "aarch64": (0xC00000B7, 220, 435, (198, 199, 425, 117, 97, 268, 33, 40))}.get(os.uname().machine)
    if arch:
        audit_arch, nr_clone, nr_clone3, denied = arch
        LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
        prog = [(LD, 0, 0, 4), (JEQ, 1, 0, audit_arch), (RET, 0, 0, 0x00050001), (LD, 0, 0, 0)]
        if audit_arch == 0xC000003E:
            prog.append((JGE, "deny", 0, 0x40000000))  # x32 syscalls
        prog += [(JEQ, "deny", 0, nr) for nr in denied]
        prog += [(JEQ, "enosys", 0, nr_clone3),  # glibc then falls back to clone()
                 (JEQ, 0, "allow", nr_clone), (LD, 0, 0, 16), (JSET, "allow", "deny", 0x10000)]
        labels = {"allow": len(prog), "deny": len(prog) + 1, "enosys": len(prog) + 2}
        prog += [(RET, 0, 0, 0x7FFF0000), (RET, 0, 0, 0x00050001), (RET, 0, 0, 0x00050026)]
        class Filt(ctypes.Structure):
            _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                        ("k", ctypes.c_uint32)]
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filt))]
        rel = lambda i, j: labels[j] - i - 1 if isinstance(j, str) else j
        filt = (Filt * len(prog))(*[Filt(c, rel(i, t), rel(i, f), k) for i, (c, t, f, k) in enumerate(prog)])
        if libc.prctl(22, C(2), ctypes.byref(Prog(len(prog), filt)), C(0), C(0)) == 0:
            layers.append("seccomp")
    # landlock
    abi = libc.syscall(C(444), None, C(0), C(1)) if landlock else 0  # LANDLOCK_CREATE_RULESET_VERSION
    if abi >= 1:
        fs_all = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1
        attr = (ctypes.c_uint64 * 3)(fs_all, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
        rfd = libc.syscall(C(444), ctypes.byref(attr), C(8 if abi < 4 else 16 if abi < 6 else 24), C(0))
        class Beneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
        def allow(path, access):  # False only if an existing path could not be added
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return True
            if not os.path.isdir(path):
                access &= 1 | 2 | 4 | (1 << 14) | (1 << 15)  # the rights a file rule may carry
            ok = libc.syscall(C(445), C(rfd), C(1), ctypes.byref(Beneath(access & fs_all, fd)), C(0)) == 0
            os.close(fd)
            return ok
        if rfd >= 0:
            exe = sys.executable
            # what the next interpreter needs: its install (also wherever its shared libraries are,
            # e.g. conda or Nix: the directories of every file mapped now), its stdlib, system libs
            mapped = set()
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith("/"):
                        mapped.add(os.path.dirname(fields[5].strip()))
            need = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                    os.path.dirname(exe), os.path.dirname(os.path.realpath(exe)), *sys.path, *mapped,
                    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime",
                    "/dev/urandom", "/dev/random"}
            ok = all([allow(p, 1 | 4 | 8) for p in need if p])  # execute, read file, read dir
            ok &= allow("/dev/null", 2 | 4 | (1 << 14))
            ok &= allow(os.getcwd(), fs_all & ~((1 << 6) | (1 << 11)))  # all but char / block devices
            # restrict only with every rule in place: a half-built ruleset could block the exec below
            if ok and libc.syscall(C(446), C(rfd), C(0)) == 0:
                layers.append("landlock%d" % abi)
            os.close(rfd)
except (OSError, AttributeError, ImportError):
    pass
os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", sys.argv[7], ",".join(layers), sys.argv[8]])
'''


def _setlit(names):
    # a set display in an `in` test compiles to a frozenset constant: nothing the child can rebind
    return "{" + ", ".join(repr(n) for n in sorted(names)) + "}"


# Stage 2: the audit hook, then main.py as __main__. The hook's constants are substituted into its
# source so they are code constants, not globals.
STAGE2 = r'''
import sys, os, builtins
sys._sandbox_layers = tuple(x for x in sys.argv[1].split(",") if x) + ("audit",)
_hidden = tuple(x for x in sys.argv[2].split("\n") if x) + ("/proc",)
sys.argv = ["main.py"]
def _make_hook(_root=os.path.realpath(os.getcwd()), _hidden=_hidden, _rp=os.path.realpath,
               _fspath=os.fspath, _isinstance=isinstance, _str=str, _bytes=bytes, _int=int,
               _Err=PermissionError):
    _created = [0]
    def _under(p, roots):  # p (a path, not a descriptor) resolved lies in one of roots
        p = _fspath(p)
        if _isinstance(p, _bytes):
            p = p.decode("utf-8", "surrogateescape")
        p = _rp(p)
        for r in roots:
            if p == r or p.startswith(r + "/"):
                return True
        return False
    def _inside(p):
        return _isinstance(p, _int) or _under(p, (_root,))  # an int: an already-open descriptor
    def hook(ev, args):
        if ev == "open":
            path, mode, flags = args
            if _isinstance(mode, _str):
                w = "w" in mode or "a" in mode or "x" in mode or "+" in mode
            else:
                w = bool(flags & 0o3103)  # O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND
            if w:
                if path is None or not _inside(path):
                    raise _Err("sandbox: writing outside the working directory is not allowed")
                _created[0] += 1
                if _created[0] > %(max_created)d:
                    raise _Err("sandbox: too many files opened for writing")
            elif path is not None and not _isinstance(path, _int) and _under(path, _hidden):
                raise _Err("sandbox: reading /proc or a hidden directory is not allowed")
        elif ev in %(blocked)s or ev.startswith(("ctypes.", "socket.", "pty.", "winreg.")):
            raise _Err("sandbox: %%s is not allowed" %% ev)
        elif ev == "import" and args[0] in %(blocked_imports)s:
            raise _Err("sandbox: importing %%s is not allowed" %% args[0])
        elif ev == "object.__setattr__" and args[1] == "__code__":
            raise _Err("sandbox: replacing __code__ is not allowed")
        elif ev in %(path_events)s:
            for p in args[:2] if ev in ("os.rename", "shutil.move", "shutil.copyfile") else args[:1]:
                if p is not None and not _inside(p):
                    raise _Err("sandbox: %%s outside the working directory is not allowed" %% ev)
    return hook
sys.addaudithook(_make_hook())
del _make_hook, _hidden
with open("main.py", "rb") as _f:
    _code = compile(_f.read(), "main.py", "exec")
exec(_code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins})
''' % dict(
    max_created=MAX_CREATED_FILES,
    blocked=_setlit({
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
        "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit",
        "resource.prlimit", "os.chdir", "os.chroot", "os.symlink", "os.link", "mmap.__new__",
        "sys.remote_exec", "os.add_dll_directory"}),
    blocked_imports=_setlit({"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters",
                             "_xxinterpchannels", "_interpreters", "cffi", "multiprocessing"}),
    path_events=_setlit({"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.truncate", "os.chmod",
                         "os.chown", "os.chflags", "os.utime", "os.setxattr", "os.removexattr",
                         "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copymode",
                         "shutil.copystat", "shutil.chown"}),
)
_STAGE2_NO_HOOK = STAGE2.replace("sys.addaudithook(_make_hook())", "pass")
assert _STAGE2_NO_HOOK != STAGE2


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def _classify(returncode, stderr):
    """Best-effort reason for a child that the parent did not kill (None if it exited by itself)."""
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    if returncode is not None and returncode < 0:
        return "signal %d" % -returncode
    if returncode and "MemoryError" in stderr[-2000:]:
        return "memory"
    return None


def run_python(code, timeout_s=5.0, memory_mb=1024, max_output_bytes=65536, cpu_s=None, files=None,
               audit_hook=True):
    """
    Run `code` (str, Python source) in a fresh sandboxed interpreter; see the module docstring.
    timeout_s: wall-clock seconds; memory_mb: address-space limit in MiB (the interpreter itself uses
    ~20 MiB of it); max_output_bytes: cap on stdout+stderr bytes; cpu_s: CPU seconds (default
    ceil(timeout_s) + 1); files: optional {plain file name: text} written next to main.py;
    audit_hook: False only in tests that check the kernel layers on their own.
    Returns dict(returncode int (negative: killed by that signal), stdout str, stderr str,
    timed_out bool, output_truncated bool, wall_s float, killed_reason None or one of
    'timeout' / 'output' / 'cpu' / 'memory' / 'signal N'). Never raises for anything the code does;
    raises ValueError for a bad file name and OSError if no process can be started at all.
    """
    cpu_s = int(math.ceil(timeout_s)) + 1 if cpu_s is None else max(1, int(math.ceil(cpu_s)))
    files = {"main.py": code, **(files or {})}
    for name in files:
        if not name or os.path.basename(name) != name or name in (".", ".."):
            raise ValueError(f"sandbox file names must be plain names, got {name!r}")
    workdir = tempfile.mkdtemp(prefix="nanoagent_sb_")
    try:
        for name, text in files.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
                f.write(text)
        hidden = "\n".join(os.path.realpath(d) for d in HIDDEN_DIRS)
        argv = [sys.executable, "-I", "-S", "-c", STAGE1, str(cpu_s), str(int(memory_mb) << 20),
                str(FILE_SIZE_MB << 20), str(MAX_OPEN_FILES), str(int(KERNEL_LAYERS)), str(int(LANDLOCK)),
                STAGE2 if audit_hook else _STAGE2_NO_HOOK, hidden]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
        with proc:
            out, err, timed_out, truncated = _collect(proc, t0 + timeout_s, max_output_bytes)
            _kill_group(proc)  # stray descendants, if any got past the guards
            returncode = proc.wait()
        wall = time.monotonic() - t0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    reason = "timeout" if timed_out else "output" if truncated else _classify(returncode, stderr)
    return dict(returncode=returncode, stdout=stdout, stderr=stderr, timed_out=timed_out,
                output_truncated=truncated, wall_s=wall, killed_reason=reason)


def _collect(proc, deadline, cap):
    """Read both pipes until EOF, the deadline (monotonic s) or more than `cap` bytes in total,
    killing the group on the last two. Returns (stdout bytes, stderr bytes, timed_out, truncated)."""
    fds = (proc.stdout.fileno(), proc.stderr.fileno())
    out = {fd: bytearray() for fd in fds}
    total, timed_out, truncated = 0, False, False
    with selectors.DefaultSelector() as sel:
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not truncated:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                out[key.fd] += chunk[:max(0, cap - total)]
                total += len(chunk)
                truncated = total > cap
    if not (timed_out or truncated) and proc.poll() is None:
        try:  # both pipes closed but the process lives on (it closed them itself): wait, bounded
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out or truncated:
        _kill_group(proc)
    return bytes(out[fds[0]]), bytes(out[fds[1]]), timed_out, truncated


def run_many(codes, workers=2, **kwargs):
    """run_python over a list of sources with a small thread pool (each run is its own process);
    returns the result dicts in input order. kwargs go to run_python."""
    if workers <= 1 or len(codes) <= 1:
        return [run_python(c, **kwargs) for c in codes]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda c: run_python(c, **kwargs), codes))


@functools.lru_cache(maxsize=1)
def sandbox_layers():
    """The protection layers active on this machine, e.g. ('rlimits', 'nocaps', 'seccomp',
    'landlock7', 'audit'); probed once by running a child."""
    res = run_python("import sys; print(','.join(sys._sandbox_layers))", timeout_s=10.0)
    if res["returncode"] != 0:
        raise RuntimeError("sandbox probe failed: " + res["stderr"][-500:])
    return tuple(res["stdout"].strip().split(","))
