"""Adversarial programs against the code sandbox: each must end with reward 0, this process alive,
and nothing leaked or still running. Short limits everywhere, so the file runs in seconds."""
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import (SANDBOX_UIDS, SandboxResult, code_reward, extract_code,  # noqa: E402
                     run_program, run_tests)

FAST = dict(timeout_s=2.0, cpu_s=1)
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


@pytest.fixture(scope="module")
def walls():
    """The isolation layers this machine gives (e.g. {"uid", "netns", "pidns", "mntns"})."""
    r = run_program("pass", **FAST)
    assert r.passed, r
    return set(filter(None, r.isolation.split(",")))


def need(walls, *any_of):
    if not walls & set(any_of):
        pytest.skip(f"needs one of {any_of}; this machine gives {sorted(walls) or 'none'}")


def alive_with_comm(tag):
    """Pids of live (non-zombie) processes whose name (/proc/PID/comm) is `tag`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if comm == tag and state not in ("Z", "X"):
            found.append(int(pid))
    return found


def tag_line(tag):
    # renaming the process lets the test find it, and its children (they inherit the name)
    return f"open('/proc/self/comm', 'w').write({tag!r})\n"


# --- honest programs ------------------------------------------------------------------------------

def test_correct_solution_passes():
    r = run_tests(ADD + "print('hello')\n", ADD_TESTS, **FAST)
    assert isinstance(r, SandboxResult)
    assert r.passed and r.status == "ok" and r.returncode == 0, r
    assert r.stdout == "hello\n"  # the pass token is stripped
    assert code_reward(ADD, ADD_TESTS, **FAST) == 1.0


def test_setup_code_runs_before_tests():
    r = run_tests("def f(x):\n    return sorted(x)\n", ["assert f(DATA) == [1, 2, 3]"],
                  setup_code="DATA = [3, 1, 2]", **FAST)
    assert r.passed, r


def test_concurrent_calls_each_pass():
    results = [None] * 4

    def one(i):
        results[i] = run_tests(ADD, ADD_TESTS, **FAST)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.passed for r in results), results


# --- plain failures and reward hacks -------------------------------------------------------------

@pytest.mark.parametrize("code", [
    "def add(a, b):\n    return a - b\n",  # wrong
    "def add(a, b) return a + b\n",  # syntax error
    ADD + "import sys\nsys.exit(0)\n",  # exit before the asserts run
    ADD + "import os\nos._exit(0)\n",
    ADD + "raise SystemExit\n",
    ADD + "import atexit, os\natexit.register(os._exit, 0)\nraise RuntimeError\n",
    ADD + "x = '\0'\n",  # a NUL byte in the source
])
def test_failures_and_early_exits_get_no_reward(code):
    r = run_tests(code, ADD_TESTS, **FAST)
    assert not r.passed and r.status == "failed", r
    assert code_reward(code, ADD_TESTS, **FAST) == 0.0


def test_swapped_stdout_still_passes():
    # The pass token goes straight to fd 1, so replacing sys.stdout neither fakes nor loses it.
    r = run_tests(ADD + "import sys, io\nsys.stdout = io.StringIO()\n", ADD_TESTS, **FAST)
    assert r.passed, r


def test_wrong_answer_reports_the_assert():
    # The program itself ran fine (exit 0); the check, done outside it, failed.
    r = run_tests("def add(a, b):\n    return a - b\n", ADD_TESTS, **FAST)
    assert r.status == "failed" and r.returncode == 0, r
    assert "AssertionError: assert add(1, 2) == 3 (got add(1, 2) = -1)" in r.stderr


# --- resource attacks ----------------------------------------------------------------------------

def test_infinite_loop_is_stopped_by_cpu_limit():
    t0 = time.monotonic()
    r = run_tests("while True:\n    pass\n", ["assert True"], **FAST)
    assert not r.passed and r.status in ("cpu_limit", "timeout"), r
    assert time.monotonic() - t0 < 5.0


def test_sleeping_loop_is_stopped_by_wall_clock():
    t0 = time.monotonic()
    r = run_tests("import time\nwhile True:\n    time.sleep(0.05)\n", ["assert True"], **FAST)
    assert not r.passed and r.status == "timeout", r
    assert 1.9 < r.elapsed_s < 3.0 and time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("namespaces", [True, False])
def test_fork_bomb_is_capped_and_cleaned_up(walls, namespaces):
    need(walls, "uid", "userns")  # RLIMIT_NPROC only works for a uid the sandbox has alone
    tag = "zb" + secrets.token_hex(4)
    # Bounded on purpose (only the first process forks, at most 200 times): if the sandbox failed,
    # this test must not take the machine down.
    code = tag_line(tag) + (
        "import os, time\n"
        "for n in range(200):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "print('forked', n + 1)\n")
    r = run_tests(code, ["assert True"], nproc=16, namespaces=namespaces, **FAST)
    assert not r.passed, r
    assert "forked 200" not in r.stdout and "BlockingIOError" in r.stderr, r
    assert alive_with_comm(tag) == []


def test_memory_bomb():
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))\n"
    r = run_tests(code, ["assert True"], mem_mb=256, **FAST)
    assert not r.passed and r.status == "memory_limit", r
    r = run_tests("x = bytearray(8 * 1024 ** 3)\n", ["assert True"], mem_mb=256, **FAST)
    assert not r.passed and r.status == "memory_limit", r


def test_huge_file_write():
    code = ("with open('big.bin', 'wb') as f:\n"
            "    for _ in range(64):\n"
            "        f.write(bytes(1024 * 1024))\n")
    r = run_tests(code, ["assert True"], fsize_mb=4, **FAST)
    assert not r.passed and "File too large" in r.stderr, r


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_printing_megabytes_is_cut_and_returns_fast(stream):
    code = f"import sys\nfor _ in range(400):\n    sys.{stream}.write('x' * 100_000)\n"
    t0 = time.monotonic()
    r = run_tests(code, ["assert True"], max_output=10_000, **FAST)
    assert not r.passed and r.status == "output_limit", r.status
    assert len(r.stdout) <= 10_000 and len(r.stderr) <= 10_000
    assert time.monotonic() - t0 < 3.0


# --- escapes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("namespaces", [True, False])
def test_escaped_grandchild_is_killed(walls, namespaces):
    """A daemon (double fork + setsid) that would write a marker after the call returns."""
    need(walls, "uid", "pidns")
    tag = "gc" + secrets.token_hex(4)
    marker = os.path.join(tempfile.gettempdir(), f"zeros-test-marker-{tag}")
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        {tag_line(tag).strip()}\n"
        "        time.sleep(1.0)\n"
        f"        open({marker!r}, 'w').write('escaped')\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n")
    try:
        r = run_program(code, namespaces=namespaces, **FAST)
        assert r.passed, r  # the program itself is fine; it is what it left behind that matters
        assert alive_with_comm(tag) == []
        time.sleep(1.3)
        assert not os.path.exists(marker)
    finally:
        if os.path.exists(marker):
            os.remove(marker)


@pytest.mark.parametrize("namespaces", [True, False])
def test_write_outside_the_temp_folder(walls, tmp_path, namespaces):
    need(walls, "uid", "mntns")
    target = tmp_path / "escape.txt"
    r = run_tests(f"open({str(target)!r}, 'w').write('pwned')\n", ["assert True"],
                  namespaces=namespaces, **FAST)
    assert not r.passed, r
    assert not target.exists()


def test_temp_folder_is_removed(walls):
    r = run_program("import os\nprint(os.getcwd())\nopen('junk', 'w').write('x')\n",
                    namespaces=False, **FAST)
    assert r.passed, r
    assert not os.path.exists(r.stdout.strip())


def test_environment_secret_is_not_inherited(monkeypatch):
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("ZEROS_SECRET", secret)
    code = "import os\nprint(dict(os.environ))\n"
    r = run_tests(code, [f"assert os.environ['ZEROS_SECRET'] == {secret!r}"], **FAST)
    assert not r.passed and "KeyError" in r.stderr, r
    assert secret not in r.stdout


def test_parent_environ_is_not_readable(walls, monkeypatch):
    need(walls, "uid", "pidns")
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("ZEROS_SECRET", secret)  # os.environ writes through to /proc/PID/environ
    code = f"print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
    r = run_tests(code, ["assert True"], **FAST)
    assert not r.passed and secret not in r.stdout, r


def test_network_is_cut_off(walls):
    need(walls, "netns")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        code = ("import socket\n"
                f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n")
        r = run_tests(code, ["assert True"], **FAST)
        assert not r.passed and "OSError" in r.stderr, r
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected


def test_cannot_signal_the_parent(walls):
    need(walls, "uid", "pidns")
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    try:
        # SIGUSR1 and not SIGKILL: if this wall ever broke, the test fails instead of pytest dying
        code = f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)\n"
        r = run_tests(code, ["assert True"], **FAST)
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert not r.passed and hits == [], r
    assert "ProcessLookupError" in r.stderr or "PermissionError" in r.stderr


# --- the filesystem view: the program sees its interpreter, not our files -----------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEEK = ADD + ("def peek(path):\n"
              "    try:\n"
              "        with open(path, 'rb') as f:\n"
              "            return f.read(64)\n"
              "    except OSError as e:\n"
              "        return repr(e)\n")


@pytest.fixture
def fake_dataset_cache():
    """An MBPP file where the datasets library caches it, under a fake HF_HOME that anyone may read,
    outside the folders the sandbox replaces with its own (/tmp...): in the git-ignored out/."""
    try:
        os.makedirs(os.path.join(ROOT, "out"), exist_ok=True)
        home = tempfile.mkdtemp(prefix="test-hf-home-", dir=os.path.join(ROOT, "out"))
    except OSError as e:
        pytest.skip(f"no folder for a fake dataset cache: {e}")
    path = os.path.join(home, "datasets", "google-research-datasets___mbpp", "full", "0.0.0",
                        secrets.token_hex(8), "mbpp-test.arrow")
    try:
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            f.write("assert add(1, 2) == 3  # the tests a program is judged by\n")
        for folder, _, _ in os.walk(home):
            os.chmod(folder, 0o755)
        os.chmod(path, 0o644)
        yield path
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("which", ["project", "dataset"])
def test_files_outside_the_view_cannot_be_read(fake_dataset_cache, which):
    path = os.path.join(ROOT, "README.md") if which == "project" else fake_dataset_cache
    with open(path, "rb") as f:
        tests = ADD_TESTS + [f"assert peek({path!r}) == {f.read(64)!r}"]
    if not run_tests(PEEK, tests, namespaces=False, **FAST).passed:  # the same program, no view
        pytest.skip(f"the sandbox cannot read {path} here even without its filesystem view")
    r = run_tests(PEEK, tests, **FAST)
    assert not r.passed and "fsview" in r.isolation and "FileNotFoundError" in r.stderr, r
    assert run_tests(PEEK, ADD_TESTS, **FAST).passed  # a correct program still earns its reward


def test_no_filesystem_view_means_no_run(tmp_path):
    """Where no mount namespace can be had, the launcher refuses instead of running the program
    with the whole filesystem in sight."""
    ran = tmp_path / "ran"
    (tmp_path / "main.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    status_r, status_w = os.pipe()
    cfg = dict(workdir=str(tmp_path), uid=None, namespaces=True, parent=os.getpid(),
               python=sys.executable, status_fd=status_w, timeout_s=2, cpu_s=1, mem_mb=512,
               fsize_mb=16, disk_mb=64, nproc=32, nofile=64)
    script = ("import json, sys, sandbox_launcher as L\n"
              "L._enter_namespaces = lambda libc, cfg: []  # as on a kernel without namespaces\n"
              "L.main(json.loads(sys.argv[1]))\n")
    subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], cwd=ROOT, timeout=30,
                   pass_fds=(status_w,))
    os.close(status_w)
    with os.fdopen(status_r, "rb") as f:
        report = json.loads(f.read())
    assert report["how"] == "setup_error" and "refusing" in report["error"], report
    assert not ran.exists()


# --- helpers -------------------------------------------------------------------------------------

def test_extract_code():
    done = "Here you go:\n```python\ndef f():\n    return 1\n```\nDone."
    assert extract_code(done) == "def f():\n    return 1\n"
    two = "```python\nfirst = 1\n```\nthen\n```py\nsecond = 2\n```\n"
    assert extract_code(two) == "second = 2\n"
    assert extract_code("```\nplain = 1\n```") == "plain = 1\n"
    assert extract_code("```python\nx = 1\n```\n```text\noutput\n```") == "x = 1\n"
    assert extract_code("```python\r\ny = 2\r\n```") == "y = 2\n"
    assert extract_code("```python\ncut = (1,\n") == "cut = (1,\n"  # hit the token limit
    assert extract_code("z = 3") == "z = 3"
    assert extract_code(None) == ""


@pytest.mark.parametrize("args, kwargs", [
    ((None, ["assert True"]), {}),
    (("x = 1", "assert True"), {}),
    (("x = 1", []), {}),
    (("x = 1", [None]), {}),
    (("x = 1", ["assert True"]), dict(timeout_s=-1)),
    (("x = 1", ["assert True"]), dict(mem_mb="lots")),
    (("x = 1", ["assert True"]), dict(no_such_limit=3)),
    (("x = 1", ["assert True"]), dict(python="/nonexistent/python3")),
])
def test_code_reward_never_raises(args, kwargs):
    assert code_reward(*args, **kwargs) == 0.0


def test_broken_interpreter_is_an_error_not_a_crash():
    r = run_tests("x = 1", ["assert True"], python="/nonexistent/python3", **FAST)
    assert not r.passed and r.status == "error" and "nonexistent" in r.stderr, r


def test_bad_limits_are_rejected_by_name():
    with pytest.raises(ValueError, match="cpu_s"):
        run_program("pass", cpu_s=0)
    with pytest.raises(ValueError, match="test_list"):
        run_tests("pass", [])


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
