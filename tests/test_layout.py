"""The house rules, read from the source with `ast`: imports run down the stages and never in a
circle, no stage file imports train.py, files and functions stay short enough to read, and Config
holds only its keys."""
import ast
import dataclasses
import os

import pytest

from config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Top to bottom: a module may import only modules below it. train.py at the top; then the CLIs of
# calibrate.py and roi.py (which build the policy as a run would); report.py; what builds a run; the
# stages; the leaves.
ORDER = ["train", "ledger", "memory", "heldout", "sparse_rollout", "calibrate", "roi", "report",
         "warmstart", "parallel",
         "checkpoint", "distill", "update", "copies", "sync", "rollout", "decode", "speculative",
         "drafts", "kvcache", "lanes", "kvpool",
         "zeros_kernels.block_sparse_bench", "zeros_kernels.block_sparse_decode",
         "zeros_kernels.sparse_decode_cpu", "sparsity",
         "prompts", "reward", "sandbox", "sandbox_harness", "sandbox_launcher", "tasks", "synthetic",
         "answers",
         "model", "lora", "moe", "zeros_kernels.linear_cpu", "zeros_kernels.cpu_ext", "config",
         "checks"]
CORE_MAX_LINES = 650
FUNCTION_MAX_LINES = 80
# the Triton kernel: one body, as the compiler wants it
EXEMPT_FUNCTIONS = {"_block_sparse_decode_kernel"}


def module_path(name):
    return os.path.join(ROOT, *name.split(".")) + ".py"


def imports(name):
    """Every module that `name` imports, at the top or inside functions."""
    tree = ast.parse(open(module_path(name)).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def local_imports(name):
    """The project modules that `name` imports."""
    return {m for m in imports(name) if m in ORDER and m != name}


def test_every_top_level_module_is_placed():
    here = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and f != "conftest.py"}
    assert here <= set(ORDER), f"place {sorted(here - set(ORDER))} in ORDER"


@pytest.mark.parametrize("name", ORDER)
def test_imports_run_down_the_stages(name):
    below = set(ORDER[ORDER.index(name) + 1:])
    up = local_imports(name) - below
    assert not up, (f"{name} imports {sorted(up)}, which sit above it (an import circle or a step "
                    f"back up)")


def test_no_import_circles():
    graph = {m: local_imports(m) for m in ORDER}
    state = {}

    def visit(m, path):
        if state.get(m) == "open":
            raise AssertionError(f"import circle: {' -> '.join(path + [m])}")
        if state.get(m) == "done":
            return
        state[m] = "open"
        for d in sorted(graph[m]):
            visit(d, path + [m])
        state[m] = "done"

    for m in ORDER:
        visit(m, [])


def test_nothing_imports_train_or_the_bench():
    for name in ORDER[1:]:
        assert not [m for m in imports(name) if m == "train" or m.split(".")[0] == "bench"], name


@pytest.mark.parametrize("name", [m for m in ORDER if not m.startswith("zeros_kernels.")])
def test_core_files_are_short(name):
    n = len(open(module_path(name)).read().splitlines())
    assert n <= CORE_MAX_LINES, f"{name}.py has {n} lines: split it along the stages"


@pytest.mark.parametrize("name", ORDER)
def test_functions_are_short(name):
    tree = ast.parse(open(module_path(name)).read())
    long = [(f.name, f.end_lineno - f.lineno + 1) for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.end_lineno - f.lineno + 1 > FUNCTION_MAX_LINES and f.name not in EXEMPT_FUNCTIONS]
    assert not long, f"{name}.py: functions over {FUNCTION_MAX_LINES} lines: {long}"


def test_config_holds_only_its_keys():
    keys = {f.name for f in dataclasses.fields(Config)}
    extra = [k for k in vars(Config) if not k.startswith("__") and k not in keys]
    assert not extra, f"Config carries more than its keys: {extra}"
    assert not [k for k in keys if k.startswith("_")]
