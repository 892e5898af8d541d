"""Adversarial programs against the code sandbox: each must end with reward 0, this process alive,
and nothing leaked or still running. Short limits everywhere, so the file runs in seconds."""
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

from sandbox import (SandboxResult, code_reward, extract_code,  # noqa: E402
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
