"""
zeros_kernels/cpu_ext.py: how the C++ CPU kernels of zeros_kernels/ are built (torch.utils.cpp_extension, on
first use, cached by torch), and how to do without them.

    ext = load_cpu_ext("sparse_decode_cpu")   # zeros_kernels/sparse_decode_cpu.cpp, built, or None
    prefetch_cpu_ext("sparse_decode_cpu")     # the same build, started in a background thread

The first build of a kernel compiles torch's headers: one to three minutes of one core on a fresh
machine. train.py starts the decode kernels' builds (attention, sparse_decode_cpu, and the
layers around it, layer_cpu: every CPU run uses both) in a background thread before the warm
start trains, one kernel after another at the lowest priority, and SFT runs on one thread
while they build, so that on a first run the compile takes one core beside SFT instead of
fighting it for both; the first load_cpu_ext of a kernel whose build is under way waits for it.
linear_cpu builds on first use, where it runs (AVX-512 and a model of hidden size 256 or more).

Each kernel is a fast path with a PyTorch reference beside it (tests check that the two agree), so
a machine without a C++ compiler or ninja runs the reference and says so once, in a warning.
ZEROS_CPU_KERNEL=0 turns every C++ kernel off.
"""

import concurrent.futures
import hashlib
import os
import threading
import time
import warnings

import torch

# the instruction set a kernel is built for, by what torch found on this CPU (a name each, so that
# a build cached for one CPU is never loaded on another)
_MARCH = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}


def lock_path(name):
    """The lock file torch takes in a build's folder while it builds."""
    from torch.utils.cpp_extension import _get_build_directory  # torch's own path for the build
    return os.path.join(_get_build_directory(name, verbose=False), "lock")


def clear_stale_lock(name, minutes=10):
    """torch guards a build with a lock file in its build folder; a process killed while it built
    leaves the file behind, and every later load then waits on it forever, silently. A lock older
    than any build (`minutes`) is removed, with a warning. -> whether one was."""
    lock = lock_path(name)
    try:
        if time.time() - os.path.getmtime(lock) < minutes * 60:
            return False
        os.remove(lock)
    except FileNotFoundError:  # no lock, or another process just took it away
        return False
    warnings.warn(f"removed a stale build lock of {name} ({lock}), left by a build that was killed")
    return True


def wait_for_lock(name, minutes=10, poll_s=1.0, log=print):
    """Wait while another process holds the build's lock (it is building the same kernel), up to
    the lock's `minutes` of age: then it is stale (clear_stale_lock) and removed. torch's own wait
    has no end, so a process that came while a killed build's lock was still young used to wait
    forever; here it waits at most until the lock turns stale, and says why it waits."""
    lock, said = lock_path(name), False
    while os.path.exists(lock) and not clear_stale_lock(name, minutes):
        if not said:
            log(f"waiting for the build of {name} that another process holds ({lock}; removed "
                f"as stale once it is {minutes} minutes old)")
            said = True
        time.sleep(poll_s)


# every kernel's build, started or done: {name: a Future of the module (or None)}
_BUILDS, _LOCK = {}, threading.Lock()


def load_cpu_ext(name):
    """zeros_kernels/<name>.cpp built as a torch extension (about a minute the first time; torch caches
    the build), or None: ZEROS_CPU_KERNEL=0, or no C++ compiler or ninja (a warning says why). A
    build that prefetch_cpu_ext started is waited for, not started again."""
    return _build(name)


def prefetch_cpu_ext(*names):
    """Start building the named kernels in one background thread, one after another, and return
    at once; nothing happens for one already built or under way, or with ZEROS_CPU_KERNEL=0. The
    thread and the compilers it starts run at the lowest priority (Linux: a thread's own nice
    value), on the core the warm start's SFT leaves them while `building()` (two builds at full
    priority beside SFT's two threads slowed SFT four times)."""
    if os.environ.get("ZEROS_CPU_KERNEL", "1") == "0":
        return
    mine = [(name, fut) for name in names for fut, first in [_claim(name)] if first]
    if not mine:
        return

    def run():
        try:
            os.nice(19)  # this thread only, on Linux; a child process inherits it
        except (AttributeError, OSError):
            pass
        for name, fut in mine:
            _run(name, fut)
    threading.Thread(target=run, name="build kernels", daemon=True).start()


def building():
    """Whether a kernel build is under way in this process (prefetch_cpu_ext's, typically): the
    warm start's SFT leaves a core to it meanwhile (warmstart.sft)."""
    with _LOCK:
        return any(not f.done() for f in _BUILDS.values())


def _claim(name):
    """-> (the Future of name's build, whether this caller is the first and must run it)."""
    with _LOCK:
        first = name not in _BUILDS
        if first:
            _BUILDS[name] = concurrent.futures.Future()
        return _BUILDS[name], first


def _run(name, fut):
    """Build name into fut: its module, or the exception for its waiters (rather than a hang)."""
    try:
        fut.set_result(_compile(name))
    except BaseException as e:
        fut.set_exception(e)


def _build(name):
    """One build per kernel and process: the first caller runs it (here, or prefetch_cpu_ext's
    thread has); every caller gets its result."""
    fut, first = _claim(name)
    if first:
        _run(name, fut)
    return fut.result()


def _compile(name):
    """The build itself -> the module, or None with a warning."""
    if os.environ.get("ZEROS_CPU_KERNEL", "1") == "0":
        return None
    isa = torch.backends.cpu.get_cpu_capability()
    # -ffast-math lets the loops vectorize (reductions reassociated); it is not passed to the link,
    # so it does not switch the process to flushing denormals
    flags = ["-O3", "-ffast-math", "-fopenmp-simd"] + ([f"-march={_MARCH[isa]}"] if isa in _MARCH
                                                        else [])
    try:
        from torch.utils.cpp_extension import load  # lazy: it pulls in the build tooling
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.cpp")
        with open(src, "rb") as f:  # the source and its path in the name: two versions never load
            # each other's build, and two checkouts never rebuild each other's (the build file
            # names the source's path, so a folder shared by two paths would rebuild at each load)
            tag = hashlib.sha1(f.read() + src.encode()).hexdigest()[:10]
        build = f"zeros_{name}_{isa.lower()}_{tag}"
        wait_for_lock(build)
        return load(build, [src], extra_cflags=flags)
    except Exception as e:  # no compiler or no ninja: the PyTorch path instead
        warnings.warn(f"the C++ kernel {name} did not build ({e}); using the PyTorch path")
        return None
