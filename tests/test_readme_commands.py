"""The README's commands stay honest: every `python train.py`, `python calibrate.py`, `python
roi.py`, `python examples/...` and `python -m bench ...` command in its code blocks (and in its
inline code, and train.py's under torchrun) names config files that exist and arguments that
parse: train.py's and calibrate.py's --key=value are config keys that config.parse_config takes
(nothing runs; a --help must exit 0), roi.py's and the examples' go through their own parsers,
and a bench section and its flags are those `python -m bench --help` lists. A path under out/
that an earlier README command writes (a mask folder, a plan file) stands in as an empty
placeholder; so does an optional tracker package that is not installed."""
import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIXES = (("python", "train.py"), ("python", "calibrate.py"), ("python", "roi.py"),
            ("python", "-m", "bench"))


def readme_commands(text):
    """[(line number, argv)] of the commands above, and of train.py's under torchrun: the lines of
    ``` blocks (a trailing backslash continues a line; `a && b` is two commands; `#` starts a
    comment) and the `...` spans of the prose (a span may wrap onto the next line)."""
    pieces, block, lines, prose = [], False, text.splitlines(), []
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            block = not block
        elif block:
            more = line.rstrip().endswith("\\") and i < len(lines)
            pieces.append((i, line.rstrip()[:-1] + " " + lines[i] if more else line))
        prose.append("" if block or line.lstrip().startswith("```") else line)
    prose = "\n".join(prose)
    for m in re.finditer(r"`(python [^`]+)`", prose):
        pieces.append((prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    found = []
    for i, piece in sorted(pieces, key=lambda p: p[0]):
        for cmd in piece.split("&&"):
            try:
                argv = shlex.split(cmd, comments=True)
            except ValueError:
                continue
            if argv[:1] == ["torchrun"] and "train.py" in argv or any(
                    tuple(argv[:len(p)]) == p for p in PREFIXES) or (
                    argv[:1] == ["python"] and argv[1:2] and argv[1].startswith("examples/")):
                found.append((i, argv))
    return found


COMMANDS = readme_commands(open(os.path.join(ROOT, "README.md")).read())


def script(argv):
    """The file a command runs (train.py under torchrun too) and its arguments."""
    at = argv.index("train.py") if argv[0] == "torchrun" else 1
    return argv[at], argv[at + 1:]


def test_the_parser_finds_the_commands():
    got = readme_commands("```bash\npip install x && python train.py --steps=3  # a comment\n"
                          "python -m bench step --threads 1\ntorchrun --nproc_per_node=2 "
                          "train.py --fsdp=true\n```\nrun `python roi.py compare` or `ls`, "
                          "`python calibrate.py\n  configs/longcot.py`\n")
    assert got == [(2, ["python", "train.py", "--steps=3"]),
                   (3, ["python", "-m", "bench", "step", "--threads", "1"]),
                   (4, ["torchrun", "--nproc_per_node=2", "train.py", "--fsdp=true"]),
                   (6, ["python", "roi.py", "compare"]),
                   (6, ["python", "calibrate.py", "configs/longcot.py"])]
    assert len([c for c in COMMANDS if script(c[1])[0] == "train.py"]) >= 10  # the README's


def placeholder(value, tmp_path):
    """A path under out/ that another command writes: an empty stand-in (a .json file, else a
    folder), the same kind:PATH prefix kept."""
    kind, sep, path = value.rpartition(":")
    if not path.startswith("out/") or os.path.exists(os.path.join(ROOT, path)):
        return value
    stand_in = tmp_path / path.replace("/", "_")
    if path.endswith(".json"):
        stand_in.write_text("{}")
    else:
        stand_in.mkdir(exist_ok=True)
    return f"{kind}{sep}{stand_in}"


def config_args(args, tmp_path):
    """train.py / calibrate.py arguments with placeholders for what other commands write."""
    keys, out = {f.name for f in dataclasses.fields(config.Config)}, []
    for a in args:
        if a.startswith("--"):
            k, _, v = a[2:].partition("=")
            assert k in keys, f"unknown config key {k!r}"
            a = f"--{k}={placeholder(v, tmp_path)}"
        else:
            assert os.path.isfile(os.path.join(ROOT, a)), f"config file {a} does not exist"
        out.append(a)
    return out


@pytest.fixture
def in_repo(monkeypatch):
    """cwd at the repository (config files are named from there); the optional trackers count as
    installed (`pip install trackio` is the README's own advice beside them)."""
    monkeypatch.chdir(ROOT)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        object() if name in ("trackio", "wandb") else real(name, *a)))


@pytest.mark.parametrize("line,argv", [c for c in COMMANDS if script(c[1])[0] in ("train.py",
                                                                                "calibrate.py")],
                         ids=lambda x: str(x) if isinstance(x, int) else None)
def test_train_and_calibrate_commands_parse(line, argv, tmp_path, in_repo, monkeypatch):
    name, args = script(argv)
    if "--help" in args or "-h" in args:  # the script's own help: it must exit 0
        r = subprocess.run([sys.executable, name] + args, cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and r.stdout, f"README.md line {line}: {r.stderr[-1000:]}"
        return
    procs = [a.split("=")[1] for a in argv if a.startswith("--nproc_per_node=")]
    if procs:  # under torchrun: as many ranks as it starts
        monkeypatch.setenv("WORLD_SIZE", procs[0])
    try:
        config.parse_config(config_args(args, tmp_path))
    except (ValueError, FileNotFoundError, AssertionError) as e:
        pytest.fail(f"README.md line {line}: `{shlex.join(argv)}`: {e}")


@pytest.mark.parametrize("line,argv", [c for c in COMMANDS if c[1][1] == "roi.py"],
                         ids=lambda x: str(x) if isinstance(x, int) else None)
def test_roi_commands_parse(line, argv, in_repo):
    import roi
    try:
        roi.build_parser().parse_args(argv[2:])
    except SystemExit:
        pytest.fail(f"README.md line {line}: `{shlex.join(argv)}` does not parse")


def example(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3],
                                                  os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("line,argv", [c for c in COMMANDS if c[1][1].startswith("examples/")],
                         ids=lambda x: str(x) if isinstance(x, int) else None)
def test_example_commands_parse(line, argv, tmp_path, in_repo):
    assert os.path.isfile(os.path.join(ROOT, argv[1])), f"README.md line {line}: no {argv[1]}"
    try:
        got = example(argv[1]).parse_args(argv[2:])
    except SystemExit:
        pytest.fail(f"README.md line {line}: `{shlex.join(argv)}` does not parse")
    if isinstance(got, tuple):  # hirelc: its own flags, then a config file and --key=value
        config.parse_config(config_args(got[1], tmp_path) or ["configs/sharpen.py"])


@pytest.fixture(scope="module")
def bench_help():
    r = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    sections = re.search(r"\{([a-z,]+)\}", r.stdout).group(1).split(",")
    return sections, set(re.findall(r"--[a-z-]+", r.stdout))


@pytest.mark.parametrize("line,argv", [c for c in COMMANDS if c[1][1] == "-m"],
                         ids=lambda x: str(x) if isinstance(x, int) else None)
def test_bench_commands_name_real_sections_and_flags(line, argv, bench_help):
    sections, flags = bench_help
    assert len(argv) > 3 and argv[3] in sections, (
        f"README.md line {line}: `{shlex.join(argv)}`: no such section (sections: "
        f"{', '.join(sections)})")
    bad = [a for a in argv[4:] if a.startswith("-") and a.split("=")[0] not in flags]
    assert not bad, f"README.md line {line}: `{shlex.join(argv)}`: unknown flags {bad}"
