"""The launcher of one sandboxed call: `python -I -S sandbox_launcher.py CFG`, run by sandbox.py.

A fresh single-threaded process (doing this in a preexec_fn of the trainer would be unsafe: it may
have threads), root when the trainer is root. It builds the walls (namespaces, a new root that
holds only the interpreter and a private /tmp, rlimits, seccomp, the sandbox uid), forks the
program, which chroots into that root, supervises it up to the timeout, kills what is left and
writes one JSON report to the status fd. When the filesystem view the call asked for cannot be
built, the program does not run: the report carries the error. sandbox.py's docstring is the
manual. It imports only the standard library: with -I the script's folder is not on sys.path.
"""
from __future__ import annotations

import json
import os
import re
import resource
import select
import signal
import sys
import time
from typing import Optional

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

# Linux constants (sched.h, mount.h, prctl.h); Python 3.11 has no os.unshare, so we use ctypes.
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
CLONE_NEWANY = 0x7E020000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 4096, 16384, 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_GET_SECCOMP, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 21, 22, 38


def _libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


def _prctl(libc, option: int, arg2=0, arg3=0) -> int:
    import ctypes  # prctl reads unsigned longs: pass them as such, not as 32-bit C ints
    wide = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in (arg2, arg3, 0, 0)]
    return libc.prctl(ctypes.c_int(option), *wide)


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
    kinds = [("netns", CLONE_NEWNET), ("pidns", CLONE_NEWPID), ("ipcns", CLONE_NEWIPC),
             ("mntns", CLONE_NEWNS)]
    if os.geteuid() == 0:
        layers += [name for name, flag in kinds if libc.unshare(flag) == 0]
        return layers
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS):
        return layers
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        with open(path, "w") as f:
            f.write(text)
    return layers + ["userns"] + [name for name, _ in kinds]


# What the program sees of the host besides its interpreter (sandbox.py adds the interpreter's own
# files in cfg["expose"]): the shared libraries and the loader's cache, the time zone, and a few
# device files. Each is bound read-only at its own path; a missing one (or a dangling link) is
# skipped, and a folder that is a link (/lib -> usr/lib on merged-/usr systems) is copied as the
# same link, what it points to being bound in its own right.
SYSTEM_PATHS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64",
                "/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo", "/dev/null",
                "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
WRITABLE = ("/tmp", "/dev/shm", "/var/tmp")  # one private tmpfs, bound on all three


def _new_root(libc, cfg: dict) -> str:
    """In our new mount namespace: the program's whole filesystem, built in a tmpfs mounted on the
    work folder, which _exec_program chroots into. Returns that folder.

    Read-only: the interpreter (cfg["expose"]) and SYSTEM_PATHS, bound at their own paths. Private:
    a size-capped tmpfs on /tmp (also bound on /dev/shm and /var/tmp) holding main.py, the
    program's cwd. Empty: /proc, until the program mounts its own. Nothing else of the host exists
    there: not the project, not a home folder, not a dataset cache. Raises OSError if any step
    fails, so that the program never runs with less (main() then refuses the call).

    Trap: mounts must first be made private, or ours would propagate back to the host.
    This runs only after unshare(CLONE_NEWNS) succeeded.
    """
    with open(os.path.join(cfg["workdir"], "main.py"), "rb") as f:
        source = f.read()  # read before the new root hides the work folder
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["workdir"]
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    bound: list = []
    for path in sorted(set(SYSTEM_PATHS) | set(cfg.get("expose") or [cfg["python"]])):
        if os.path.exists(path) and not any(_inside(path, b) for b in bound):
            _expose(libc, root, path)
            bound.append(path)
    tmp = root + "/tmp"
    _make_dirs(root, "/tmp")
    opts = f"size={int(cfg['disk_mb'])}m,nr_inodes=4096,mode=700"
    if cfg["uid"] is not None:
        opts += f",uid={cfg['uid']},gid={cfg['uid']}"
    _mount(libc, "tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for other in WRITABLE[1:]:
        _make_dirs(root, other)
        _mount(libc, tmp, root + other, None, MS_BIND)
    _make_dirs(root, "/proc")
    with open(tmp + "/main.py", "wb") as f:
        f.write(source)
    if cfg["uid"] is not None:
        os.chown(tmp + "/main.py", cfg["uid"], cfg["uid"])
    _read_only_below(libc, root, skip={root + w for w in WRITABLE})
    return root


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _make_dirs(root: str, path: str) -> None:
    """mkdir -p `path` under `root`, each new folder 0755 whatever our umask."""
    at = root
    for part in path.strip("/").split("/"):
        at = os.path.join(at, part)
        if not os.path.lexists(at):
            os.mkdir(at)
            os.chmod(at, 0o755)


def _expose(libc, root: str, path: str) -> None:
    """Bind host `path` (a folder, with what is mounted below it, or a file) at the same path under
    `root`; a folder that is a link becomes the same link. Made read-only by _read_only_below."""
    target = root + path
    _make_dirs(root, os.path.dirname(path))
    if os.path.islink(path) and os.path.isdir(path):
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        _make_dirs(root, path)
    else:
        with open(target, "wb"):
            pass  # the mount point of a file is a file
    _mount(libc, path, target, None, MS_BIND | MS_REC)


def _read_only_below(libc, root: str, skip: set) -> None:
    """Remount read-only every mount at or below `root` but those in `skip`. These are bind
    remounts in our namespace: the host's mounts keep their flags. Raises OSError if one fails.

    Trap: in a user namespace the host's nosuid, nodev, noexec and atime flags are locked, and a
    remount that would drop one is refused; so each remount repeats them.
    """
    with open("/proc/self/mountinfo") as f:  # field 5: the mount point, with octal escapes
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
                  for line in f]
    locked = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME
    for point in points:
        if _inside(point, root) and point not in skip:
            flags = os.statvfs(point).f_flag
            keep = (flags & locked) | (MS_RELATIME if flags & os.ST_RELATIME else 0)
            _mount(libc, None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


# seccomp: the system calls the program may not make (EPERM). Namespaces, mounts and chroot (a user
# namespace can mount a tmpfs that no cap covers), memfd and System V / POSIX IPC (memory that
# RLIMIT_AS does not count; SysV segments even outlive the process), and kernel interfaces a
# program has no use for. Numbers for x86_64 and aarch64.
_SECCOMP_DENY = {
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "chroot": (161, 51), "memfd_create": (319, 279),
    "memfd_secret": (447, 447), "shmget": (29, 194), "msgget": (68, 186), "mq_open": (240, 180),
    "bpf": (321, 280), "io_uring_setup": (425, 425), "userfaultfd": (323, 282),
    "perf_event_open": (298, 241)}
_SECCOMP_CLONE, _SECCOMP_CLONE3 = (56, 220), (435, 435)
_AUDIT_ARCH = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column, AUDIT_ARCH_*


def _seccomp_filter(column: int, audit_arch: int) -> bytes:
    """The classic-BPF program, run on each system call's struct seccomp_data (nr at offset 0,
    arch at 4, args from 16)."""
    import errno
    import struct
    op = lambda code, k, jt=0, jf=0: struct.pack("=HBBI", code, jt, jf, k)  # noqa: E731
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, deny, nosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    prog = [op(load, 4), op(jeq, audit_arch, 1, 0), op(ret, deny),  # another ABI (i386): no
            op(load, 0), op(jge, 0x40000000, 0, 1), op(ret, deny)]  # x32 calls: no
    for numbers in _SECCOMP_DENY.values():
        prog += [op(jeq, numbers[column], 0, 1), op(ret, deny)]
    # clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes glibc fall back
    # to clone, whose flags we can see; fork and threads pass, new namespaces do not.
    prog += [op(jeq, _SECCOMP_CLONE3[column], 0, 1), op(ret, nosys),
             op(jeq, _SECCOMP_CLONE[column], 0, 3), op(load, 16), op(jset, CLONE_NEWANY, 0, 1),
             op(ret, deny), op(ret, allow)]
    return b"".join(prog)


def _seccomp_available(libc) -> bool:
    return os.uname().machine in _AUDIT_ARCH and _prctl(libc, PR_GET_SECCOMP) >= 0


def _install_seccomp(libc) -> None:
    """Load the filter for this process and everything it starts; it survives execve."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = _seccomp_filter(*_AUDIT_ARCH[os.uname().machine])
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    # no_new_privs: needed to load a filter without root; also, no setuid binary can undo it
    if _prctl(libc, PR_SET_NO_NEW_PRIVS, 1) != 0 or \
            _prctl(libc, PR_SET_SECCOMP, 2, ctypes.byref(fprog)) != 0:  # 2: SECCOMP_MODE_FILTER
        errno = ctypes.get_errno()
        raise OSError(errno, f"seccomp filter: {os.strerror(errno)}")


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


def _exec_program(libc, cfg: dict, layers: list, root: Optional[str], errpipe: int) -> None:
    """In the forked child: last walls, drop root, exec the program. Never returns.

    With a new root (_new_root) the program is chrooted into it, its cwd the private /tmp; else its
    cwd is the work folder. The chroot cannot be undone: the program has no capabilities left and
    seccomp refuses chroot, mount and pivot_root.
    """
    if root is not None:
        if "pidns" in layers:
            try:  # a /proc that shows only the sandbox's own processes; else /proc stays empty
                _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:
                pass
        os.chroot(root)
    workdir = "/tmp" if root is not None else cfg["workdir"]
    os.chdir(workdir)
    _set_limits(cfg, layers)  # before setuid: an unprivileged process cannot raise hard limits
    if "uid" in layers:
        uid = cfg["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # real, effective and saved: no way back to root
    # Die with the launcher. Set after setuid, because changing the uid clears it.
    _prctl(libc, PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if "seccomp" in layers:
        _install_seccomp(libc)  # last: mounting /proc above needs mount(2)
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


def _supervise(libc, cfg: dict, layers: list, root: Optional[str], stop: list) -> dict:
    """Fork the program, wait for it up to timeout_s (or a stop request), kill it, reap it."""
    err_r, err_w = os.pipe()  # close-on-exec: EOF at a successful exec, else the error text
    t0 = time.monotonic()
    pid = os.fork()  # with a new PID namespace, this child is its PID 1
    if pid == 0:
        try:
            os.close(err_r)
            _exec_program(libc, cfg, layers, root, err_w)
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


def main(cfg: dict) -> None:
    """The launcher: set up, supervise, clean up, and write one JSON report to the status fd."""
    status_fd = int(cfg["status_fd"])
    os.set_inheritable(status_fd, False)  # the program must not get it
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    report: dict = {}
    try:
        libc = _libc()
        # When the trainer dies (kill -9 included), SIGTERM takes the stop path: the program is
        # killed and its uid swept. Trap: the signal follows the *thread* that started us; that
        # thread waits for us (_wait_launcher), so it cannot end first. It may be gone already.
        _prctl(libc, PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != cfg["parent"]:
            stop[0] = True
        layers = _enter_namespaces(libc, cfg)
        root = None
        if cfg["namespaces"]:  # the filesystem view, or no run at all
            if "mntns" not in layers:
                raise OSError("no mount namespace here (needs root or user namespaces), so no "
                              "filesystem view: refusing to run the program (namespaces=False "
                              "runs it without one)")
            root = _new_root(libc, cfg)
            layers += ["fsview", "rofs"]
        layers += ["seccomp"] if _seccomp_available(libc) else []
        report["layers"] = layers
        sweep = "uid" in layers and "pidns" not in layers  # a PID namespace needs no sweep
        if sweep:
            _sweep(cfg["uid"])  # leftovers of a caller that crashed while holding this uid
        report.update(_supervise(libc, cfg, layers, root, stop))
        if sweep:
            _sweep(cfg["uid"])
    except BaseException as e:
        report.update(how="setup_error", error=f"{type(e).__name__}: {e}")
    try:
        os.write(status_fd, json.dumps(report).encode())
    except OSError:
        pass  # the trainer is gone: nobody to tell


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
