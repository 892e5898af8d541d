"""Reported holes in the code sandbox, each closed: shared writable folders, memory outside the
process caps, reward hacks on the checker, the assert forms judged outside the program, and a
killed trainer. Each program must end with reward 0, this process alive, nothing leaked."""
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import SANDBOX_UIDS, code_reward, run_program, run_tests  # noqa: E402
from tests.test_sandbox import (ADD_TESTS, FAST, alive_with_comm, need, tag_line,  # noqa: E402
                                walls)  # noqa: F401  (a fixture: pytest finds it by name)

# --- reported holes: shared folders, memory outside the caps, reward hacks, a killed trainer -----

BIG = dict(timeout_s=10.0, cpu_s=5)


def world_writable_dirs(top="/", depth=4):
    """Folders anyone may write to, as this host sees them (the attack below looks for the same)."""
    found, todo = [], [(top, 1)]
    while todo:
        folder, level = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            try:
                if e.path in ("/proc", "/sys") or not e.is_dir(follow_symlinks=False):
                    continue
                if e.stat(follow_symlinks=False).st_mode & 0o002:
                    found.append(e.path)
            except OSError:
                continue
            if level < depth:
                todo.append((e.path, level + 1))
    return found


def spill_program(tag):
    """Walks what it sees for folders it may write to, outside its own /tmp, and fills them."""
    return (
        "import os\n"
        "def spill():\n"
        "    own = {'/proc', '/sys', '/tmp', '/dev/shm', '/var/tmp'}\n"
        "    todo, written = [('/', 1)], 0\n"
        "    while todo:\n"
        "        folder, level = todo.pop()\n"
        "        try:\n"
        "            entries = list(os.scandir(folder))\n"
        "        except OSError:\n"
        "            continue\n"
        "        for e in entries:\n"
        "            if e.path in own or not e.is_dir(follow_symlinks=False):\n"
        "                continue\n"
        "            if level < 4:\n"
        "                todo.append((e.path, level + 1))\n"
        "            for i in range(10):  # 10 x 16 MB: past disk_mb=64\n"
        "                try:\n"
        f"                    with open(os.path.join(e.path, '{tag}-%d' % i), 'wb') as f:\n"
        "                        for _ in range(16):\n"
        "                            f.write(bytes(1 << 20))\n"
        "                    written += 16 << 20\n"
        "                except OSError:\n"
        "                    break\n"
        "    return written\n"
        "def found():\n"
        f"    return [p for p in {world_writable_dirs()!r} if os.path.exists(p)\n"
        f"            and [n for n in os.listdir(p) if n.startswith('{tag}')]]\n")


def test_no_shared_writable_folder_outside_the_private_tmp(walls):
    """Hole 14: /run/lock (and any other world-writable folder) took 160 MB past a 64 MB disk
    cap, kept it on the host, and the next call read it back."""
    need(walls, "mntns")
    tag = "zeros-test-spill-" + secrets.token_hex(4)
    code = spill_program(tag)
    try:
        r = run_tests(code, ["assert spill() >= 160 * 2**20"], disk_mb=64, fsize_mb=16, **BIG)
        assert not r.passed, r
        r = run_tests(code, ["assert found()"], **BIG)  # the next call finds nothing either
        assert not r.passed, r
        left = [d for d in world_writable_dirs() if any(n.startswith(tag) for n in os.listdir(d))]
        assert left == [], left
    finally:
        for d in world_writable_dirs():
            for n in os.listdir(d):
                if n.startswith(tag):
                    os.remove(os.path.join(d, n))


USERNS_TMPFS = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def hold():\n"
    "    uid, gid = os.getuid(), os.getgid()\n"
    "    if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS\n"
    "        raise OSError(ctypes.get_errno(), 'unshare')\n"
    "    for path, text in (('/proc/self/setgroups', 'deny'),\n"
    "                       ('/proc/self/uid_map', f'0 {uid} 1'),\n"
    "                       ('/proc/self/gid_map', f'0 {gid} 1')):\n"
    "        with open(path, 'w') as f:\n"
    "            f.write(text)\n"
    "    os.makedirs('/tmp/big', exist_ok=True)\n"
    "    if libc.mount(b'none', b'/tmp/big', b'tmpfs', 0, b'size=12g') != 0:\n"
    "        raise OSError(ctypes.get_errno(), 'mount')\n"
    "    held = 0\n"
    "    for i in range(32):\n"
    "        with open(f'/tmp/big/{i}', 'wb') as f:\n"
    "            for _ in range(16):\n"
    "                f.write(bytes(1 << 20))\n"
    "        held += 16 << 20\n"
    "    return held\n")

MEMFD = (
    "import os\n"
    "fds = []\n"
    "def hold():\n"
    "    for i in range(20):\n"
    "        fd = os.memfd_create(f'hold{i}')\n"
    "        for _ in range(16):\n"
    "            os.write(fd, bytes(1 << 20))\n"
    "        fds.append(fd)\n"
    "    return sum(os.fstat(fd).st_size for fd in fds)\n")

SYSV_SHM = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.shmat.restype = ctypes.c_void_p\n"
    "def hold():\n"
    "    held = 0\n"
    "    for i in range(20):\n"
    "        sid = libc.shmget(0, 16 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600\n"
    "        if sid < 0:\n"
    "            raise OSError(ctypes.get_errno(), 'shmget')\n"
    "        addr = libc.shmat(sid, None, 0)\n"
    "        ctypes.memset(addr, 1, 16 << 20)\n"
    "        libc.shmdt(ctypes.c_void_p(addr))\n"
    "        held += 16 << 20\n"
    "    return held\n")


def sandbox_shm_segments():
    """(shmid, uid) of the SysV shared memory segments that sandbox uids own on this host."""
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [(int(r[1]), int(r[7])) for r in rows if int(r[7]) in SANDBOX_UIDS]


@pytest.mark.parametrize("name, code, want_mb", [
    ("userns_tmpfs", USERNS_TMPFS, 512),  # hole 15
    ("memfd", MEMFD, 320),                # hole 16
    ("sysv_shm", SYSV_SHM, 320),          # hole 16's cousin: it also outlived the call
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 else "")
def test_memory_outside_the_process_cap_is_refused(walls, name, code, want_mb):
    need(walls, "seccomp")
    try:
        r = run_tests(code, [f"assert hold() >= {want_mb} * 2**20"], mem_mb=128, disk_mb=64,
                      **BIG)
        assert not r.passed, (name, r)
        assert "Error" in r.stderr, (name, r)  # refused with an error, not killed at the cap
        assert sandbox_shm_segments() == []
    finally:
        import ctypes
        for shmid, _ in sandbox_shm_segments():
            ctypes.CDLL(None).shmctl(shmid, 0, None)  # IPC_RMID


SKIP_ASSERTS = (  # a tracer that jumps over every assert line of the main file
    "import sys\n"
    "def add(a, b):\n"
    "    return 0\n"
    "_lines = open(__file__).read().splitlines()\n"
    "def _skip(frame, event, arg):\n"
    "    if event == 'line' and frame.f_code.co_filename == __file__:\n"
    "        n = frame.f_lineno\n"
    "        if _lines[n - 1].lstrip().startswith('assert'):\n"
    "            while not _lines[n].strip():\n"
    "                n += 1\n"
    "            frame.f_lineno = n + 1\n"
    "    return _skip\n"
    "sys.settrace(_skip)\n"
    "sys._getframe().f_trace = _skip\n")

TOKEN_FROM_SOURCE = (
    "import os, re\n"
    "def add(a, b):\n"
    "    return 0\n"
    "for tok in set(re.findall(r'[0-9a-f]{32}', open(__file__).read())):\n"
    "    os.write(1, f'\\n{tok}\\n'.encode())\n"
    "    os.write(1, f'\\n{tok}[]\\n'.encode())\n"
    "os._exit(0)\n")

TOKEN_FROM_CONSTS = (
    "import os, sys\n"
    "def add(a, b):\n"
    "    return 0\n"
    "for c in sys._getframe().f_code.co_consts:\n"
    "    if isinstance(c, str):\n"
    "        c = c.encode()\n"
    "    if isinstance(c, bytes) and len(c.strip()) >= 32:\n"
    "        os.write(1, c)\n"
    "os._exit(0)\n")

ALWAYS_EQUAL = (
    "class _Any:\n"
    "    def __eq__(self, other):\n"
    "        return True\n"
    "    def __ne__(self, other):\n"
    "        return False\n"
    "    __hash__ = object.__hash__\n"
    "def add(a, b):\n"
    "    return _Any()\n")

ALWAYS_EQUAL_FLOAT = (
    "class _F(float):\n"
    "    __eq__ = lambda self, other: True\n"
    "    __ne__ = lambda self, other: False\n"
    "    __hash__ = float.__hash__\n"
    "def add(a, b):\n"
    "    return _F(0)\n")


@pytest.mark.parametrize("code", [SKIP_ASSERTS, TOKEN_FROM_SOURCE, TOKEN_FROM_CONSTS,
                                  ALWAYS_EQUAL, ALWAYS_EQUAL_FLOAT],
                         ids=["settrace", "source", "co_consts", "always_equal", "float_eq"])
def test_reward_hacks_on_the_checker_get_no_reward(code):
    """Hole 17: each of these earned the reward when the program checked itself."""
    r = run_tests(code, ADD_TESTS, **FAST)
    assert not r.passed and r.status != "ok", r
    assert code_reward(code, ADD_TESTS, **FAST) == 0.0


FORMS = {  # the MBPP shapes of assert: a right and a wrong solution for each
    "eq": ("def f(x):\n    return x * 2\n", "def f(x):\n    return x\n",
           ["assert f(2)==4", "assert f(3) == 6"]),
    "isclose": ("import math\ndef area(r):\n    return math.pi * r * r\n",
                "def area(r):\n    return 3 * r * r\n",
                ["assert math.isclose(area(2), 12.566, rel_tol=0.001)"]),
    "set": ("def common(a, b):\n    return tuple(set(a) & set(b))\n",
            "def common(a, b):\n    return (4,)\n",
            ["assert set(common((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))"]),
    "truth": ("def odd(n):\n    return n % 2 == 1\n", "def odd(n):\n    return 1\n",
              ["assert odd(3)", "assert not odd(2)"]),
    "tuple_not_list": ("def pair(a):\n    return (a, [a], {a: a})\n",
                       "def pair(a):\n    return [a, [a], {a: a}]\n",
                       ["assert pair(1) == (1, [1], {1: 1})"]),
    "is_none": ("def nothing(x):\n    return None\n", "def nothing(x):\n    return 0\n",
                ["assert nothing(1) is None"]),
    "index": ("def first(x):\n    return x[0]\n", "def first(x):\n    return x[-1]\n",
              ["assert first('abc') in ('a', 'z')", "assert first([3, 4]) + 1 == 4"]),
    "strings": ("def up(s):\n    return s.upper()\n", "def up(s):\n    return s\n",
                ['assert up("it\'s") == "IT\'S"']),
}


@pytest.mark.parametrize("name", FORMS)
def test_assert_forms_are_judged_outside_the_program(name):
    good, bad, tests = FORMS[name]
    r = run_tests(good, tests, **FAST)
    assert r.passed, r
    r = run_tests(bad, tests, **FAST)
    assert not r.passed and r.status == "failed" and "AssertionError" in r.stderr, r


def test_expected_values_of_the_setup_code_stay_out_of_the_program():
    setup = "DATA = [3, 1, 2]\nEXPECTED = sorted(DATA)"
    tests = ["assert f(DATA) == EXPECTED"]
    assert run_tests("def f(x):\n    return sorted(x)\n", tests, setup_code=setup, **FAST).passed
    for hack in ("def f(x):\n    return EXPECTED\n",  # read it: it is not in the program
                 "def f(x):\n    globals()['EXPECTED'] = []\n    return []\n"):  # or change it
        r = run_tests(hack, tests, setup_code=setup, **FAST)
        assert not r.passed, r


@pytest.mark.parametrize("tests", [
    ["for i in range(3):\n    assert f(i) == i"],     # an assert inside a loop
    ["assert all(f(x) == x for x in range(3))"],      # the expected value inside the call
    ["assert f(1) =="],                               # broken
])
def test_tests_that_cannot_be_judged_outside_are_an_error(tests):
    r = run_tests("def f(x):\n    return x\n", tests, **FAST)
    assert not r.passed and r.status == "error" and "cannot check" in r.stderr, r
    assert code_reward("def f(x):\n    return x\n", tests, **FAST) == 0.0


@pytest.mark.parametrize("test", ["assert 2 ** f(1) == 4", "assert 'ab' * f(1) == 'abab'",
                                  "assert round(1.5, f(1)) == 2"])
def test_huge_values_cannot_stall_the_checker(test):
    t0 = time.monotonic()
    r = run_tests("def f(x):\n    return 10 ** 9\n", [test], **FAST)
    assert not r.passed and "too" in r.stderr, r
    assert time.monotonic() - t0 < 3.0


def test_root_gets_every_wall(walls):
    if os.geteuid() != 0 or "mntns" not in walls:
        pytest.skip("needs root and a mount namespace")
    assert {"uid", "netns", "pidns", "ipcns", "rofs", "seccomp"} <= walls


def find_workdirs(text):
    """Work folders on this host (this version's layout and the one before) whose main.py
    contains `text`."""
    tmp = tempfile.gettempdir()
    found = []
    for pattern in ("zeros-sandbox-run-*", "zeros-sandbox-runs-*/*"):
        for folder in glob.glob(os.path.join(tmp, pattern)):
            try:
                with open(os.path.join(folder, "main.py")) as f:
                    if text in f.read():
                        found.append(folder)
            except OSError:
                pass
    return found


@pytest.mark.parametrize("namespaces", [True, False])
def test_killed_trainer_leaves_no_program_and_no_files(walls, namespaces):
    """Hole 18: after kill -9 of the trainer its program ran on to the timeout, and its work folder
    (code and tests) stayed on disk."""
    need(walls, "uid", "userns")
    tag = "kt" + secrets.token_hex(4)
    code = tag_line(tag) + "import time\ntime.sleep(60)\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (f"import sys; sys.path.insert(0, {root!r}); import sandbox; "
              f"sandbox.run_program({code!r}, timeout_s=60, cpu_s=60, "
              f"namespaces={namespaces!r})")
    trainer = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 15
        while not alive_with_comm(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive_with_comm(tag), "the program never started"
        assert find_workdirs(tag)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 3
        while alive_with_comm(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive_with_comm(tag) == []
        assert run_program("pass", **FAST).passed  # a fresh call sweeps what the dead one left
        assert find_workdirs(tag) == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for pid in alive_with_comm(tag):
            os.kill(pid, signal.SIGKILL)
        for folder in find_workdirs(tag):
            shutil.rmtree(folder, ignore_errors=True)
