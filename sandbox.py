"""Run model-written Python in a throwaway sandbox, for the rewards of code tasks (stage 3).

A completion for a code task is untrusted: it may loop forever, fork until the machine stops, eat
the memory, fill the disk, read our secrets, call the network, or kill the trainer. `run_program`
runs it in a separate, locked-down process and always comes back, with a `SandboxResult`; nothing
the program started is still running when it returns (with root or user namespaces; see 4).
Statuses: ok, failed, timeout, cpu_limit, memory_limit, output_limit, killed, error.

How one call runs:

    trainer (this module)              the parent: writes main.py, reads output, enforces the cap
      `- launcher (python sandbox.py)  root if we are root: sets up the walls, supervises, cleans up
           `- program (python main.py) the model's code + the tests, as an unprivileged uid

The walls, each used where the OS allows it (`SandboxResult.isolation` says which were in effect):
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
  - pidns, netns, mntns: Linux namespaces (as root; otherwise inside a user namespace, "userns", if
    the kernel allows them for unprivileged users). In a new PID namespace the program is PID 1:
    when it exits or is killed, the kernel kills everything it started, and it cannot see our pids.
    The network namespace has no interfaces up, so every connection fails, even to localhost. The
    mount namespace gets a private size-capped tmpfs on /tmp (also bound on /dev/shm and /var/tmp),
    which is the program's cwd and vanishes with it, and a /proc that shows only its own processes.

Simplifications and limits (read before trusting a reward):
  1. Not a security boundary against a determined attacker: no seccomp, no cgroups, the same
     kernel. It is built against accidents and reward hacks of a policy model, not against exploits.
  2. "passed" means: the program exited 0 *and* printed a random token placed after the last test.
     So `sys.exit(0)` / `os._exit(0)` before the asserts fails. A program that reads its own source
     or its code object can still find the token; so can one whose objects compare equal to all.
  3. Memory is capped per process (RLIMIT_AS), not per sandbox: with nproc processes the total can
     reach nproc * mem_mb. cgroups would fix this; they are not used.
  4. Without root and without user namespaces only rlimits, the process group and the wall clock
     remain: the program could then signal our process, escape the kill with setsid(), read the
     network, and RLIMIT_NPROC is not set (it would count all of our user's processes).
  5. Without the mount namespace the program can still write to world-writable folders such as
     /tmp (capped per file by fsize_mb) and can see other processes in /proc.
  6. Output is cut at max_output bytes per stream; a program over the cap is stopped
     ("output_limit"). Python runs with -I -S: the standard library only, no site-packages, no
     `exit()` builtin (use `sys.exit`).
  7. When our interpreter is not readable by the sandbox uid (e.g. it lives in root's home), the
     sandbox uses the first `python3` on the standard PATH that it can run (`python=` chooses).
  8. Each call starts two interpreters: about 0.1-0.2 s of overhead. Run calls in threads for
     throughput; each concurrent call holds its own sandbox uid (SANDBOX_SLOTS of them).

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
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

# Dedicated uids for sandboxed programs when we run as root: one per concurrent call, so that
# RLIMIT_NPROC and the final kill(-1) sweep only ever touch that call's processes. They must not
# belong to anyone else on the machine (change the base if they do).
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_SLOTS = 64
SANDBOX_UIDS = range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_SLOTS)
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_GRACE_S = 10.0  # the parent's backstop past timeout_s, in case the launcher itself hangs

# Linux constants (sched.h, mount.h, prctl.h); Python 3.11 has no os.unshare, so we use ctypes.
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1


@dataclass
class SandboxResult:
    passed: bool        # exited 0 after running every line, tests included
    status: str         # ok failed timeout cpu_limit memory_limit output_limit killed error
    returncode: Optional[int]  # exit code; -N when killed by signal N; None when it never ran
    stdout: str         # at most max_output bytes, decoded
    stderr: str
    elapsed_s: float    # wall time of the program itself
    isolation: str = ""  # the walls in effect, e.g. "uid,netns,pidns,mntns"


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
    """Run `code`, then `tests` (more Python, e.g. asserts), in a sandbox; see the module docstring.

    timeout_s: wall clock; cpu_s: CPU seconds per process; mem_mb: address space per process;
    fsize_mb: largest file it may write; disk_mb: size of its tmpfs /tmp (mount namespace only);
    nproc: processes and threads; nofile: open files; max_output: bytes kept per stream;
    namespaces=False skips the Linux namespaces (uid and rlimits still apply).
    """
    limits = dict(timeout_s=timeout_s, cpu_s=cpu_s, mem_mb=mem_mb, fsize_mb=fsize_mb,
                  disk_mb=disk_mb, nproc=nproc, nofile=nofile, max_output=max_output)
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"run_program: {name} must be a positive number, got {value!r}")
    if not isinstance(code, str) or not isinstance(tests, str):
        raise TypeError("run_program: code and tests must be str")
    token = secrets.token_hex(16)
    # The token is written by the last line, straight to fd 1: a program that exits early, or
    # swaps sys.stdout, never prints it. Flush first so that its own output comes before the token.
    source = (f"{code}\n\n{tests}\n\n"
              "try:\n    __import__('sys').stdout.flush()\nexcept BaseException:\n    pass\n"
              f"__import__('os').write(1, b'\\n{token}\\n')\n")
    with _uid_slot() as uid:
        workdir = tempfile.mkdtemp(prefix="zeros-sandbox-run-")
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(source)
            if uid is not None:
                os.chown(workdir, uid, uid)  # the program writes here when there is no tmpfs
            interpreter = python or _sandbox_python(uid)
            cfg = dict(limits, workdir=workdir, uid=uid, python=interpreter,
                       namespaces=bool(namespaces))
            raw = _launch(cfg, int(max_output))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return _classify(raw, token, float(cpu_s))


def run_tests(code: str, test_list: list, setup_code: str = "", **limits) -> SandboxResult:
    """MBPP style: `code`, then `setup_code`, then each test (an assert) in order.

    Passed only if every assert passes. An empty test list is an error, not a free pass.
    """
    if not isinstance(test_list, (list, tuple)) or not test_list or \
            not all(isinstance(t, str) for t in test_list):
        raise ValueError("run_tests: test_list must be a non-empty list of str (asserts)")
    tests = "\n".join([setup_code, *test_list])
    return run_program(code, tests, **limits)


def code_reward(code: str, test_list: list, **limits) -> float:
    """1.0 if `code` passes every test in the sandbox, else 0.0. Never raises: any error is 0.0."""
    try:
        return 1.0 if run_tests(code, test_list, **limits).passed else 0.0
    except Exception:  # a reward must not take down the training loop
        return 0.0


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


def _launch(cfg: dict, max_output: int) -> dict:
    """Start the launcher, read its output with a cap, and wait for it (never past the backstop).

    Returns the launcher's report plus stdout/stderr bytes and flags. The launcher runs in its own
    session, so the backstop can SIGKILL the whole process group.
    """
    status_r, status_w = os.pipe()
    cfg["status_fd"] = status_w
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--launch", json.dumps(cfg)]
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


def _classify(raw: dict, token: str, cpu_s: float) -> SandboxResult:
    """Turn the launcher's report into a SandboxResult (status, passed, cleaned output)."""
    out = raw["stdout"].decode("utf-8", errors="replace")
    err = raw["stderr"].decode("utf-8", errors="replace")
    how, code = raw.get("how"), raw.get("code")
    marker = f"\n{token}\n"
    finished = marker in out
    out = out.replace(marker, "")
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
        if code == 0 and finished:
            status = "ok"
        elif last[0].startswith("MemoryError"):
            status = "memory_limit"
        else:
            status = "failed"
    else:  # the launcher failed before or while starting the program
        status = "error"
        why = raw.get("error") or f"launcher exited with {raw.get('launcher_rc')} and no report"
        err = f"{err}\nsandbox error: {why}".lstrip("\n")
    elapsed = raw.get("elapsed", raw["parent_elapsed"])
    return SandboxResult(passed=status == "ok", status=status, returncode=rc, stdout=out,
                         stderr=err, elapsed_s=round(float(elapsed), 4),
                         isolation=",".join(raw.get("layers", [])))


# ----------------------------------------------------------------------------------------------
# launcher side: `python -I -S sandbox.py --launch CFG`, a fresh single-threaded process.
# (Doing this in a preexec_fn of our own process would be unsafe: it may have threads.)


def _libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, source: Optional[str], target: str, fstype: Optional[str], flags: int,
           data: Optional[str] = None) -> None:
    import ctypes
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or source} on {target}: {os.strerror(errno)}")


def _enter_namespaces(libc, cfg: dict) -> list:
    """Unshare what this kernel lets us; returns the layers in effect.

    As root each namespace is tried alone, so one refused kind does not cost the others. Without
    root they only come together with a user namespace, mapped to our own uid and gid only.
    """
    layers = ["uid"] if cfg["uid"] is not None else []
    if not cfg["namespaces"]:
        return layers
    kinds = [("netns", CLONE_NEWNET), ("pidns", CLONE_NEWPID), ("mntns", CLONE_NEWNS)]
    if os.geteuid() == 0:
        layers += [name for name, flag in kinds if libc.unshare(flag) == 0]
        return layers
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS) != 0:
        return layers
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)
    return layers + ["userns"] + [name for name, _ in kinds]


def _private_tmp(libc, cfg: dict) -> str:
    """In our new mount namespace: a size-capped tmpfs on /tmp holding main.py; returns it.

    Trap: mounts must first be made private, or the tmpfs would propagate back to the host's /tmp.
    This runs only after unshare(CLONE_NEWNS) succeeded.
    """
    with open(os.path.join(cfg["workdir"], "main.py"), "rb") as f:
        source = f.read()  # read before the tmpfs hides the host's /tmp
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    opts = f"size={int(cfg['disk_mb'])}m,nr_inodes=4096,mode=700"
    if cfg["uid"] is not None:
        opts += f",uid={cfg['uid']},gid={cfg['uid']}"
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for other in ("/dev/shm", "/var/tmp"):
        if os.path.isdir(other):
            try:
                _mount(libc, "/tmp", other, None, MS_BIND)
            except OSError:
                pass  # still capped per file by RLIMIT_FSIZE
    path = "/tmp/main.py"
    with open(path, "wb") as f:
        f.write(source)
    if cfg["uid"] is not None:
        os.chown(path, cfg["uid"], cfg["uid"])
    return "/tmp"


def _set_limits(cfg: dict, layers: list) -> None:
    mb = 1 << 20
    cpu = max(1, int(-(-float(cfg["cpu_s"]) // 1)))  # whole seconds, rounded up
    # soft == hard: SIGKILL when the CPU time runs out. (A SIGXCPU at a lower soft limit would be
    # ignored anyway by a program that is PID 1 of its namespace, or caught by a clever one.)
    caps = [(resource.RLIMIT_CPU, cpu, cpu),
            (resource.RLIMIT_AS, int(cfg["mem_mb"]) * mb, int(cfg["mem_mb"]) * mb),
            (resource.RLIMIT_FSIZE, int(cfg["fsize_mb"]) * mb, int(cfg["fsize_mb"]) * mb),
            (resource.RLIMIT_NOFILE, int(cfg["nofile"]), int(cfg["nofile"])),
            (resource.RLIMIT_CORE, 0, 0)]
    if "uid" in layers or "userns" in layers:
        # RLIMIT_NPROC counts every process of the real uid (in its user namespace); it is only
        # meaningful when that uid is the sandbox's alone. Root ignores it, hence the uid switch.
        caps.append((resource.RLIMIT_NPROC, int(cfg["nproc"]), int(cfg["nproc"])))
    for which, soft, hard in caps:
        resource.setrlimit(which, (soft, hard))


def _exec_program(libc, cfg: dict, layers: list, workdir: str, errpipe: int) -> None:
    """In the forked child: last walls, drop root, exec the program. Never returns."""
    if "pidns" in layers and "mntns" in layers:
        try:  # a /proc that shows only the sandbox's own processes
            _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            pass
    os.chdir(workdir)
    _set_limits(cfg, layers)  # before setuid: an unprivileged process cannot raise hard limits
    if "uid" in layers:
        uid = cfg["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # real, effective and saved: no way back to root
    # Die with the launcher. Set after setuid, because changing the uid clears it.
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    os.closerange(3, errpipe)
    os.closerange(errpipe + 1, 1 << 20)
    env = {"PATH": SAFE_PATH, "HOME": workdir, "LANG": "C.UTF-8"}
    python = cfg["python"]
    os.execve(python, [python, "-I", "-S", os.path.join(workdir, "main.py")], env)


def _uid_alive(uid: int) -> bool:
    """Is any live (non-zombie) process running with `uid` as its real, effective or saved uid?"""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue  # it exited while we looked
        zombie = fields.get("State", "").split()[:1] == ["Z"]
        if str(uid) in fields.get("Uid", "").split()[:3] and not zombie:
            return True
    return False


def _sweep(uid: int) -> None:
    """SIGKILL every process of `uid`, from a helper running as that uid: kill(-1) reaches all of
    them at once, setsid() escapes and processes forked meanwhile included.

    Trap: kill(-1) returns success as long as any other process exists on the machine, so it
    cannot tell us when we are done; /proc can. Zombies are left to their reaper.
    """
    deadline = time.monotonic() + 2.0
    while _uid_alive(uid) and time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)  # everything we may signal, but ourselves
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.002)


def _supervise(libc, cfg: dict, layers: list, workdir: str, stop: list) -> dict:
    """Fork the program, wait for it up to timeout_s (or a stop request), kill it, reap it."""
    err_r, err_w = os.pipe()  # close-on-exec: EOF at a successful exec, else the error text
    t0 = time.monotonic()
    pid = os.fork()  # with a new PID namespace, this child is its PID 1
    if pid == 0:
        try:
            os.close(err_r)
            _exec_program(libc, cfg, layers, workdir, err_w)
        except BaseException as e:
            os.write(err_w, f"{type(e).__name__}: {e}".encode()[:4000])
        os._exit(127)
    os.close(err_w)
    with os.fdopen(err_r, "rb") as f:
        setup_error = f.read().decode(errors="replace")
    try:
        waiter = os.pidfd_open(pid)
    except (AttributeError, OSError):
        waiter = None
    how, deadline = None, t0 + float(cfg["timeout_s"])
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if stop[0] or time.monotonic() > deadline:
            how = "stopped" if stop[0] else "timeout"
            os.kill(pid, signal.SIGKILL)  # as PID 1, this takes its whole namespace with it
            _, status, usage = os.wait4(pid, 0)
            break
        if waiter is not None:
            select.select([waiter], [], [], min(0.05, max(0.0, deadline - time.monotonic())))
        else:
            time.sleep(0.005)
    elapsed = time.monotonic() - t0
    if waiter is not None:
        os.close(waiter)
    if setup_error:
        return dict(how="setup_error", error=setup_error, elapsed=elapsed)
    if how is None:
        how = "signal" if os.WIFSIGNALED(status) else "exit"
    code = os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return dict(how=how, code=code, elapsed=elapsed,
                cpu_used=usage.ru_utime + usage.ru_stime)


def _launcher_main(cfg: dict) -> None:
    """The launcher: set up, supervise, clean up, and write one JSON report to the status fd."""
    status_fd = int(cfg["status_fd"])
    os.set_inheritable(status_fd, False)  # the program must not get it
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    report: dict = {}
    try:
        libc = _libc()
        layers = _enter_namespaces(libc, cfg)
        workdir = cfg["workdir"]
        if "mntns" in layers:
            try:
                workdir = _private_tmp(libc, cfg)
            except OSError:
                layers.remove("mntns")
        report["layers"] = layers
        sweep = "uid" in layers and "pidns" not in layers  # a PID namespace needs no sweep
        if sweep:
            _sweep(cfg["uid"])  # leftovers of a caller that crashed while holding this uid
        report.update(_supervise(libc, cfg, layers, workdir, stop))
        if sweep:
            _sweep(cfg["uid"])
    except BaseException as e:
        report.update(how="setup_error", error=f"{type(e).__name__}: {e}")
    os.write(status_fd, json.dumps(report).encode())


def _demo() -> None:
    add = "def add(a, b):\n    return a + b\n"
    cases = [("correct", add, ["assert add(1, 2) == 3"]),
             ("wrong", "def add(a, b):\n    return a - b\n", ["assert add(1, 2) == 3"]),
             ("early exit", "import os\nos._exit(0)\n" + add, ["assert add(1, 2) == 3"]),
             ("infinite loop", "while True:\n    pass\n", ["assert True"]),
             ("network", "import socket\nsocket.create_connection(('1.1.1.1', 53), 2)\n",
              ["assert True"])]
    for name, code, tests in cases:
        r = run_tests(code, tests, timeout_s=3, cpu_s=2)
        last = (r.stderr.strip().splitlines() or [""])[-1][:60]
        print(f"{name:14s} passed={r.passed!s:5s} status={r.status:12s} "
              f"{r.elapsed_s:6.2f}s  [{r.isolation}]  {last}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launch"]:
        _launcher_main(json.loads(sys.argv[2]))
    else:
        _demo()
