"""Run model-written Python in a throwaway sandbox, for the rewards of code tasks (stage 3).

A completion for a code task is untrusted: it may loop forever, fork until the machine stops, eat
the memory, fill the disk, read our secrets, call the network, kill the trainer, or game its tests.
`run_program` runs it in a separate, locked-down process and always comes back, with a
`SandboxResult`; nothing the program started is still running when it returns (but with
namespaces=False and no root; see 4). It sees almost nothing of the machine: its interpreter, the
system's shared libraries and a private /tmp; not our files, nor the datasets' tests. Statuses: ok,
failed, timeout, cpu_limit, memory_limit, output_limit, killed, error (which includes "this machine
cannot build the walls": see 4).

How one call runs:

    trainer (this module)                  the parent: splits the tests, writes main.py, reads the
      |                                    output with a cap, judges the asserts
      `- launcher (sandbox_launcher.py)    root if we are root: builds the walls, supervises,
           |                               cleans up; stops when the trainer dies
           `- program (python main.py)     the model's code, then the harness, which evaluates the
                                           calls under test; as an unprivileged uid, in a new
                                           root that holds its interpreter and little else

The tests are judged here, never by the program (sandbox_harness.py): each assert is split into
the calls to the program's code, which the program evaluates and returns as plain JSON data, and
the rest (the expected value, the comparison), which we evaluate on that data. The program never
sees an expected value and gives no verdict: tracing itself past the asserts, printing a token
read from its source, or returning an object that equals everything earns nothing. "passed" means:
the program exited 0 after returning a value for every call, and every assert holds on them.

The walls, each used where the OS allows it, but fsview and rofs, without which the program does not
run (see 4); `SandboxResult.isolation` says which were in effect:
  - rlimits set in the program before exec: CPU seconds, address space (memory), size of a written
    file, open files, processes, and no core dumps;
  - its own session and process group, an empty environment (only PATH, HOME, LANG), stdin from
    /dev/null, no inherited file descriptors, a fresh temporary folder as cwd, removed afterwards;
  - uid: when we run as root, the program runs as a dedicated unprivileged uid (one of
    SANDBOX_UIDS, held with a lock file for the call). RLIMIT_NPROC is not enforced for root, so
    this is what makes the process cap real; it also means the program cannot signal us, read our
    /proc/<pid>/environ, or write the files of root. Without a PID namespace, every process of
    that uid is killed after the run (kill(-1) from a helper running as that uid), which also
    catches what escaped the process group with setsid();
  - pidns, netns, ipcns, mntns: Linux namespaces (as root; otherwise inside a user namespace,
    "userns", if the kernel allows them for unprivileged users). In a new PID namespace the program
    is PID 1: when it exits or is killed, the kernel kills everything it started, and it cannot see
    our pids. The network namespace has no interfaces up, so every connection fails, even to
    localhost. System V and POSIX IPC objects die with the IPC namespace. The mount namespace holds
    the program's filesystem (fsview);
  - fsview: the program is chrooted into a new root, a tmpfs built in its mount namespace, that
    holds only, each at its own path:
      - its interpreter: the executable, the standard library folder (lib-dynload and
        site-packages inside it; site-packages is not on sys.path), libpython if shared. We ask the
        interpreter itself, once per process (_interpreter_files); a venv or a pyenv shim resolves
        to the real interpreter, which runs the program (with -I -S it runs the same code);
      - the system's shared libraries and the loader's cache: /lib*, /usr/lib*, /etc/ld.so.cache;
        the time zone: /etc/localtime, /usr/share/zoneinfo; /dev/null, zero, full, random, urandom;
      - a private size-capped tmpfs on /tmp (also bound on /dev/shm and /var/tmp), which holds
        main.py, is the program's cwd and HOME, and vanishes with it;
      - /proc: one that shows only its own processes (with pidns), else an empty folder.
    Nothing else of the host exists there: not the project's tree, not a home folder, not a
    dataset cache (the MBPP tests in ~/.cache/huggingface), nor the rest of /etc, /usr/bin, a shell
    (subprocess can start only the interpreter itself). A folder that holds the interpreter, e.g.
    /root for a pyenv install, shows only the interpreter's files;
  - rofs: every mount in that root is read-only, but the private /tmp (and /proc), so nothing of
    the host takes a byte;
  - seccomp (x86_64, aarch64; with or without namespaces): the program may not create namespaces
    (unshare, setns, clone with CLONE_NEW*, clone3), mount anything, chroot, or call memfd_create,
    shmget, msgget, mq_open, bpf, io_uring_setup, userfaultfd, perf_event_open. A user namespace
    could mount a tmpfs outside disk_mb; memfd and IPC memory is not counted by RLIMIT_AS. With
    no capability left (a sandbox uid, or a uid other than 0 in the user namespace), chroot is
    refused anyway: the program cannot leave its root;
  - a killed trainer (kill -9 included): the kernel sends the launcher SIGTERM (parent-death
    signal), which stops the program and sweeps its uid; the program itself dies with the launcher.
    Work folders are named after their owner process, and each call removes those of dead owners.

Simplifications and limits (read before trusting a reward):
  1. Not a security boundary against a determined attacker: no cgroups, the same kernel, seccomp as
     a deny list. It is built against accidents and reward hacks of a policy model, not exploits.
  2. The values of the calls under test must be plain data: None, bool, int, float, str, bytes,
     complex, and lists, tuples, dicts, sets of them (subclasses are copied as their base class);
     anything else fails the test. They count toward max_output. Tests that cannot be split safely
     (an assert in a loop or a function, a comparison inside a call to the program, tests that do
     not parse) are not run: status "error", reward 0. Names that we evaluate in an assert (len,
     sorted, set, math.isclose...) are Python's, even where the program defines its own. Setup
     code runs in the program (less what only builds expected values): it can read those names.
  3. Memory is capped per process (RLIMIT_AS), not per sandbox: with nproc processes the total can
     reach nproc * mem_mb, plus disk_mb of tmpfs and kernel buffers (pipes, sockets; nofile bounds
     them). cgroups would give one cap; they are not used.
  4. The filesystem view needs a mount namespace: root, or user namespaces for unprivileged users.
     Where there is none, or any step of building the view fails, the program does not run: the
     call returns status "error" ("sandbox error: ... refusing ..."), reward 0. The other
     namespaces are used where the kernel gives them (isolation says which). namespaces=False runs
     the program without any namespace, hence without the view (for tests and debugging, not for
     rewards): it then reads every file its uid may read (the project, world-readable caches),
     writes to world-writable folders such as /tmp (capped per file by fsize_mb; what it writes
     stays) and sees other processes in /proc. Without root as well, only rlimits, seccomp, the
     process group and the wall clock remain: the program could then signal our process, escape
     the kill with setsid(), read the network, and RLIMIT_NPROC is not set.
  5. Inside the view the program still reads what is bound there, all of it public: the system's
     libraries and the interpreter's site-packages (not on sys.path, but a program may add them).
  6. Output is cut at max_output bytes per stream; a program over the cap is stopped
     ("output_limit"). Python runs with -I -S: the standard library only, no site-packages, no
     `exit()` builtin (use `sys.exit`).
  7. When our interpreter is not readable by the sandbox uid on the host (e.g. it lives in root's
     home), the sandbox uses the first `python3` on the standard PATH that it can run (`python=`
     chooses). Its real path is the one that runs (see fsview).
  8. Each call starts two interpreters: about 0.1-0.2 s of overhead. Tests whose expected values
     need their own setup code (`assert f(x) == EXPECTED`) take a second run, without the program.
     Run calls in threads for throughput; each concurrent call holds its own sandbox uid
     (SANDBOX_SLOTS of them).

Example:

    from sandbox import run_tests, code_reward, extract_code
    code = extract_code(completion)                      # last ```python block, else the text
    r = run_tests(code, ["assert add(1, 2) == 3"], timeout_s=5)
    r.passed, r.status, r.stderr[-300:]                  # True, "ok", ""
    code_reward(code, ["assert add(1, 2) == 3"])         # 1.0 or 0.0, never raises

`python sandbox.py` runs a few programs and prints which walls this machine allows.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import sandbox_launcher
from sandbox_harness import Uncheckable, child_program, judge, plan_tests, take_values
from sandbox_launcher import SAFE_PATH

# Dedicated uids for sandboxed programs when we run as root: one per concurrent call, so that
# RLIMIT_NPROC and the final kill(-1) sweep only ever touch that call's processes. They must not
# belong to anyone else on the machine (change the base if they do).
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_SLOTS = 64
SANDBOX_UIDS = range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_SLOTS)
_GRACE_S = 10.0  # the parent's backstop past timeout_s, in case the launcher itself hangs


@dataclass
class SandboxResult:
    passed: bool        # exited 0 with a value for every call under test; every assert held
    status: str         # ok failed timeout cpu_limit memory_limit output_limit killed error
    returncode: Optional[int]  # exit code; -N when killed by signal N; None when it never ran
    stdout: str         # at most max_output bytes, decoded
    stderr: str
    elapsed_s: float    # wall time of the program itself
    isolation: str = ""  # the walls in effect, e.g. "uid,netns,pidns,ipcns,mntns,rofs,seccomp"


def extract_code(completion: str) -> str:
    """The code of a model completion: its last ```python fenced block (```py too).

    Falls back to the last fenced block without a language tag, then to the whole text. A final
    block that was cut off by the token limit (no closing fence) still counts: the code in it is
    usually broken, and the tests will say so.
    """
    if not isinstance(completion, str):
        return ""
    text = completion.replace("\r\n", "\n")
    blocks = re.findall(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", text, flags=re.DOTALL)
    for want in (("python", "py", "python3"), ("",)):
        found = [body for lang, body in blocks if lang.lower() in want]
        if found:
            return found[-1].strip("\n") + "\n"
    return text


# ----------------------------------------------------------------------------------------------
# parent side: the calling process


def run_program(code: str, tests: str = "", *, timeout_s: float = 5.0, cpu_s: float = 5,
                mem_mb: int = 512, fsize_mb: int = 16, disk_mb: int = 64, nproc: int = 32,
                nofile: int = 64, max_output: int = 64_000, namespaces: bool = True,
                python: Optional[str] = None) -> SandboxResult:
    """Run `code`, then `tests` (setup statements and asserts), in a sandbox; see the module
    docstring. The asserts are judged here on the values the program returns (sandbox_harness).

    timeout_s: wall clock; cpu_s: CPU seconds per process; mem_mb: address space per process;
    fsize_mb: largest file it may write; disk_mb: size of its tmpfs /tmp (mount namespace only);
    nproc: processes and threads; nofile: open files; max_output: bytes kept per stream;
    namespaces=False skips the Linux namespaces and with them the filesystem view (uid, rlimits
    and seccomp still apply): for tests and debugging, never for rewards (docstring, 4).
    """
    limits = dict(timeout_s=timeout_s, cpu_s=cpu_s, mem_mb=mem_mb, fsize_mb=fsize_mb,
                  disk_mb=disk_mb, nproc=nproc, nofile=nofile, max_output=max_output)
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"run_program: {name} must be a positive number, got {value!r}")
    if not isinstance(code, str) or not isinstance(tests, str):
        raise TypeError("run_program: code and tests must be str")
    try:
        plan = plan_tests(tests)
    except Uncheckable as e:
        return _refusal(f"cannot check these tests outside the program: {e}")
    opts = dict(limits, namespaces=bool(namespaces), python=python)
    expected: list = []
    if plan.evals("clean"):  # expected values built by the tests' own code: never the program's
        clean, expected = _run_steps("", plan.clean, opts)
        if expected is None:
            return _refusal("the tests fail without the program, so their expected values are "
                            f"unknown: {clean.status}: {clean.stderr.strip()[-300:]}")
    result, got = _run_steps(code, plan.child, opts)
    if got is not None:
        result.passed, why = judge(plan, got, expected)
        if not result.passed:
            result.status, result.stderr = "failed", f"{result.stderr}{why}\n"
    return result


def run_tests(code: str, test_list: list, setup_code: str = "", **limits) -> SandboxResult:
    """MBPP style: `code`, then `setup_code`, then each test (an assert) in order.

    Passed only if every assert passes. An empty test list is an error, not a free pass.
    """
    if not isinstance(test_list, (list, tuple)) or not test_list or \
            not all(isinstance(t, str) for t in test_list):
        raise ValueError("run_tests: test_list must be a non-empty list of str (asserts)")
    tests = "\n".join([setup_code, *test_list])
    return run_program(code, tests, **limits)


def _refusal(why: str) -> SandboxResult:
    return SandboxResult(passed=False, status="error", returncode=None, stdout="",
                         stderr=f"sandbox error: {why}", elapsed_s=0.0)


def code_reward(code: str, test_list: list, **limits) -> float:
    """1.0 if `code` passes every test in the sandbox, else 0.0. Never raises: any error is 0.0."""
    try:
        return 1.0 if run_tests(code, test_list, **limits).passed else 0.0
    except Exception:  # a reward must not take down the training loop
        return 0.0


def _run_steps(code: str, steps: list, opts: dict) -> tuple:
    """One sandboxed run of `code` then the harness `steps`: (SandboxResult, the values it
    returned, or None unless it ran to the end and exited 0)."""
    marker = secrets.token_hex(16)
    with _uid_slot() as uid:
        workdir = _new_workdir()
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(child_program(code, steps, marker))
            if uid is not None:
                os.chown(workdir, uid, uid)  # the program writes here when there is no tmpfs
            cfg = dict(opts, workdir=workdir, uid=uid, parent=os.getpid(),
                       python=opts["python"] or _sandbox_python(uid))
            if cfg["namespaces"]:  # the new root holds the interpreter's files, at their paths
                try:
                    cfg["python"], cfg["expose"] = _interpreter_files(cfg["python"])
                except RuntimeError as e:
                    return _refusal(str(e)), None
            raw = _launch(cfg, int(opts["max_output"]))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return _classify(raw, marker, float(opts["cpu_s"]))


def _new_workdir() -> str:
    """A fresh work folder, named after this process (pid and start time), so that a later call
    can tell that its owner died without cleaning up (kill -9) and remove it."""
    runs = os.path.join(tempfile.gettempdir(), f"zeros-sandbox-runs-{os.geteuid()}")
    os.makedirs(runs, mode=0o711, exist_ok=True)
    st = os.lstat(runs)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():  # e.g. a link planted in /tmp
        raise RuntimeError(f"sandbox: {runs} is not a folder of ours")
    os.chmod(runs, 0o711)  # the sandbox uid may pass through to its folder, not list the others
    for name in os.listdir(runs):
        pid, start = (name.split("-") + ["", ""])[:2]
        if pid.isdigit() and _start_time(int(pid)) != start:
            shutil.rmtree(os.path.join(runs, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-{_start_time(os.getpid())}-", dir=runs)


def _start_time(pid: int) -> str:
    """When process `pid` started (clock ticks after boot), "" if there is none. With the pid it
    names one process, even once the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


@contextmanager
def _uid_slot() -> Iterator[Optional[int]]:
    """Hold one of SANDBOX_UIDS for the call (None when we are not root and cannot switch uid).

    The lock is an flock on a file per uid, so it is shared by threads and by other processes on
    the machine (several trainer ranks) and is released even if we crash.
    """
    if os.geteuid() != 0:
        yield None
        return
    lockdir = os.path.join(tempfile.gettempdir(), "zeros-sandbox-uids")
    os.makedirs(lockdir, mode=0o700, exist_ok=True)
    deadline = time.monotonic() + 60
    while True:
        for uid in SANDBOX_UIDS:
            fd = os.open(os.path.join(lockdir, f"{uid}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield uid
            finally:
                os.close(fd)  # closing the file releases the lock
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sandbox: all {SANDBOX_SLOTS} sandbox uids stayed busy for 60 s")
        time.sleep(0.05)


_python_for_uid: Optional[str] = None


def _sandbox_python(uid: Optional[int]) -> str:
    """An interpreter the sandbox uid can run. Ours may live in a home folder it cannot enter."""
    global _python_for_uid
    if uid is None:
        return sys.executable
    if _python_for_uid is None:
        candidates = [sys.executable, shutil.which("python3", path=SAFE_PATH)]
        for exe in filter(None, candidates):
            try:
                ok = subprocess.run([exe, "-I", "-S", "-c", "pass"], user=uid, group=uid,
                                    extra_groups=[], env={"PATH": SAFE_PATH}, cwd="/",
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, timeout=30).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            if ok:
                _python_for_uid = exe
                break
        else:
            raise RuntimeError(f"sandbox: no Python interpreter that uid {uid} can run; tried "
                               f"{candidates}; pass python=... (a world-readable install)")
    return _python_for_uid


_INTERPRETER_QUERY = """
import json, os, sys, sysconfig
files = {os.path.realpath(sys.executable), sysconfig.get_path("stdlib"),
         sysconfig.get_path("platstdlib")}
if sysconfig.get_config_var("Py_ENABLE_SHARED"):
    files.add(os.path.join(sysconfig.get_config_var("LIBDIR") or "/",
                           sysconfig.get_config_var("INSTSONAME") or ""))
files = sorted(f for f in files if f and os.path.exists(f))
print(json.dumps([os.path.realpath(sys.executable), files]))
"""
_files_of: dict = {}


def _interpreter_files(python: str) -> tuple:
    """(the interpreter's real path, the files it needs to start: itself, its standard library,
    its libpython if shared), asked once of the interpreter itself. A venv or a wrapper (a pyenv
    shim) resolves to the real interpreter: with -I -S it runs the same programs. Bound read-only
    into the program's new root by the launcher; site-packages come along (inside the standard
    library folder) but are not on sys.path."""
    if python not in _files_of:
        try:
            out = subprocess.run([python, "-I", "-S", "-c", _INTERPRETER_QUERY], cwd="/",
                                 env={"PATH": SAFE_PATH}, stdin=subprocess.DEVNULL,
                                 capture_output=True, timeout=30, check=True).stdout
            exe, files = json.loads(out)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            raise RuntimeError(f"cannot ask the interpreter {python} for its files: {e}") from None
        _files_of[python] = (exe, files)
    return _files_of[python]


def _launch(cfg: dict, max_output: int) -> dict:
    """Start the launcher, read its output with a cap, and wait for it (never past the backstop).

    Returns the launcher's report plus stdout/stderr bytes and flags. The launcher runs in its own
    session, so the backstop can SIGKILL the whole process group.
    """
    status_r, status_w = os.pipe()
    cfg["status_fd"] = status_w
    argv = [sys.executable, "-I", "-S", os.path.abspath(sandbox_launcher.__file__), json.dumps(cfg)]
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={"PATH": SAFE_PATH}, cwd="/",
                                pass_fds=(status_w,), start_new_session=True)
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    overflow = threading.Event()
    bufs: list = [bytearray(), bytearray()]
    readers = [threading.Thread(target=_drain, args=(pipe, bufs[i], max_output, overflow),
                                daemon=True) for i, pipe in enumerate((proc.stdout, proc.stderr))]
    for t in readers:
        t.start()
    backstop = _wait_launcher(proc, t0 + float(cfg["timeout_s"]) + _GRACE_S, overflow)
    for t in readers:
        t.join(timeout=2.0)  # a process outside the group may still hold the pipe (no-root case)
    os.set_blocking(status_r, False)  # written before the launcher exited; never wait for more
    with os.fdopen(status_r, "rb") as f:
        try:
            report_text = f.read() or b""
        except BlockingIOError:
            report_text = b""
    try:
        report = json.loads(report_text) if report_text else {}
    except ValueError:
        report = {}
    report.update(stdout=bytes(bufs[0]), stderr=bytes(bufs[1]), overflow=overflow.is_set(),
                  backstop=backstop, launcher_rc=proc.returncode,
                  parent_elapsed=time.monotonic() - t0)
    return report


def _wait_launcher(proc: subprocess.Popen, deadline: float, overflow: threading.Event) -> bool:
    """Wait for the launcher; ask it to stop at an output overflow; SIGKILL its group at the
    backstop deadline (returns True then). Reaps it, after a last killpg for stragglers."""
    stopped = backstop = False
    t0 = time.monotonic()
    while True:
        # WNOWAIT: see that it exited without reaping it, so its pid (our process group id)
        # cannot be reused by a stranger before the killpg below.
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break
        if overflow.is_set() and not stopped:
            os.kill(proc.pid, signal.SIGTERM)  # the launcher stops the program and cleans up
            stopped = True
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            backstop = True
        time.sleep(0.005 if time.monotonic() - t0 < 0.5 else 0.02)  # most programs are quick
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group (the no-root fallback)
    except ProcessLookupError:
        pass
    proc.wait()
    return backstop


def _drain(pipe, buf: bytearray, cap: int, overflow: threading.Event) -> None:
    """Read a pipe to its end, keeping the first `cap` bytes; past the cap, drop and flag."""
    fd = pipe.fileno()
    try:
        while chunk := os.read(fd, 65536):
            room = cap - len(buf)
            if len(chunk) > room:
                buf += chunk[:max(room, 0)]
                overflow.set()  # keep reading, so the writer never blocks on a full pipe
            else:
                buf += chunk
    except OSError:
        pass
    finally:
        pipe.close()


def _classify(raw: dict, marker: str, cpu_s: float) -> tuple:
    """The launcher's report as (SandboxResult, the values the harness wrote, or None unless the
    program ran to its end and exited 0). "ok" here only means that; judge() gives the verdict."""
    out = raw["stdout"].decode("utf-8", errors="replace")
    err = raw["stderr"].decode("utf-8", errors="replace")
    how, code = raw.get("how"), raw.get("code")
    values, out = take_values(out, marker)
    rc = None if code is None else (-code if how == "signal" else code)
    if raw["overflow"] or how == "stopped":
        status = "output_limit"
    elif raw["backstop"] or how == "timeout":
        status = "timeout"
    elif how == "signal":
        # The CPU cap kills with SIGKILL (see _set_limits): judge by the CPU time it used. Trap:
        # rusage samples, and reads up to ~10% below the precise clock the limit uses.
        limit = max(1, -(-cpu_s // 1))
        hit_cpu = code == signal.SIGXCPU or raw.get("cpu_used", 0.0) >= 0.75 * limit
        status = "cpu_limit" if hit_cpu else "killed"
    elif how == "exit":
        last = err.strip().splitlines()[-1:] or [""]
        if code == 0 and values is not None:
            status = "ok"
        elif last[0].startswith("MemoryError"):
            status = "memory_limit"
        else:
            status = "failed"
            err += "sandbox: the program exited 0 before its tests ran\n" if code == 0 else ""
    else:  # the launcher failed before or while starting the program
        status = "error"
        why = raw.get("error") or f"launcher exited with {raw.get('launcher_rc')} and no report"
        err = f"{err}\nsandbox error: {why}".lstrip("\n")
    elapsed = raw.get("elapsed", raw["parent_elapsed"])
    result = SandboxResult(passed=status == "ok", status=status, returncode=rc, stdout=out,
                           stderr=err, elapsed_s=round(float(elapsed), 4),
                           isolation=",".join(raw.get("layers", [])))
    return result, (values if status == "ok" else None)


def _demo() -> None:
    add = "def add(a, b):\n    return a + b\n"
    cases = [("correct", add, ["assert add(1, 2) == 3"]),
             ("wrong", "def add(a, b):\n    return a - b\n", ["assert add(1, 2) == 3"]),
             ("early exit", "import os\nos._exit(0)\n" + add, ["assert add(1, 2) == 3"]),
             ("always equal", "class A:\n    __eq__ = lambda s, o: True\n"
              "def add(a, b):\n    return A()\n", ["assert add(1, 2) == 3"]),
             ("memfd", "import os\nos.memfd_create('x')\n", ["assert True"]),
             ("infinite loop", "while True:\n    pass\n", ["assert True"]),
             ("network", "import socket\nsocket.create_connection(('1.1.1.1', 53), 2)\n",
              ["assert True"])]
    for name, code, tests in cases:
        r = run_tests(code, tests, timeout_s=3, cpu_s=2)
        last = (r.stderr.strip().splitlines() or [""])[-1][:60]
        print(f"{name:14s} passed={r.passed!s:5s} status={r.status:12s} "
              f"{r.elapsed_s:6.2f}s  [{r.isolation}]  {last}")


if __name__ == "__main__":
    _demo()
