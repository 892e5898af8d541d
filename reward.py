"""Rewards for GRPO (stage 3): the verifier cascade. Cheap checks first; most completions end in a zero.

A completion goes down the stages and stops at the first that decides it, so the expensive stages
see only what the cheap ones let through:
    1 dedup   identical completions within a group are scored once; the copies get the same reward
    2 cheap   an answer is extractable and non-empty (code: a ```python block that ast.parse
              accepts), at most max_chars long. A failure scores 0 and stops
    3 exact   the answer equals the reference after normalize_answer (a clear pass), or both are
              plain integers and their values decide (072 = 72 passes, 71 != 72 fails); either
              way it stops here. Only what neither settles goes on
    4 verify  math-verify symbolic equivalence for math, gsm8k and synthetic answers (1/2 = 0.5 =
              \\frac{1}{2}, "9>" = 9); the unit tests in the sandbox (sandbox.py) for code
    5 judge   optional, a callable (prompt, completion, reference) -> float (a small model, a user
              function): a second look at what was rejected (judge_on="rejected") or a grade for
              what passed ("passed"); tasks with no verifier go to it directly
`Cascade.score_batch` returns a RewardResult: per completion the reward, the stage that decided it
and that call's seconds; per stage the completions that reached it and its time; the errors and
timeouts. `summary()` gives the short dict for the log line. A verifier or judge that raises or
hangs gives 0, is counted, and never stops the loop: math-verify runs in a worker process that is
killed at its deadline (it hangs for good on 10^{10^{10^{10}}}), the judge in a thread.

Simplifications:
  1. Dedup matches exact text within a group; near-duplicates are scored separately.
  2. For gsm8k the format check accepts the last number of the text when there is no "####".
  3. Code scores 1 only if every assert of test_list passes (no partial credit); MBPP's challenge
     tests stay in meta, unused.
  4. A judge call past its deadline is abandoned, not killed (threads cannot be): a judge that
     hangs for good keeps one idle thread per call.
  5. A math-verify worker stuck when the trainer dies lives on until its memory cap or its alarm.
  6. `score` / `score_one` are the cheap path alone (stage 3, no processes) for quick checks.
  7. Only integers are settled by value: decimals and expressions go to math-verify, which rounds
     (it calls 0.333333 and 0.3333333 equal) and reads expressions, where a cheap rule could disagree.

    with Cascade(max_chars=8000) as cascade:
        res = cascade.score_batch(problems, completions, group_size=8)
    res.rewards, res.stages, res.summary()  # {"reach_exact": .., "reach_verify": .., ...}

`python reward.py` scores a small hand-made batch and prints what decided each completion.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from queue import Queue
from typing import Callable, Optional, Sequence

from sandbox import extract_code, run_program, run_tests
from tasks import EXTRACTORS, Problem, extract_answer

def normalize_answer(s: Optional[str]) -> str:
    """A small canonical form so that trivially different spellings compare equal.

    In order: drop "\\left"/"\\right", "$" and all whitespace; remove thousands commas
    ("1,234,567" -> "1234567", while "(1,2)" keeps its comma); strip a trailing "."; drop a zero
    fractional part ("5.0", "5.00" -> "5"). Anything smarter (fractions vs decimals, symbolic
    equivalence) belongs to the verifier, not here. None normalizes to "".
    """
    if s is None:
        return ""
    s = str(s).replace("\\left", "").replace("\\right", "").replace("$", "")
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = s.rstrip(".")
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)
    return s


_INTEGER = re.compile(r"(-?)0*(\d+)")


def _integer(s: str) -> Optional[str]:
    """A canonical spelling of a plain integer ("-007" -> "-7", "-0" -> "0"), or None. Strings, not
    int(): Python refuses to convert integers of more than 4,300 digits."""
    m = _INTEGER.fullmatch(s)
    if m is None:
        return None
    return m.group(2) if m.group(2) == "0" else m.group(1) + m.group(2)


def cheap_verdict(pred: Optional[str], gold: Optional[str]) -> Optional[bool]:
    """The cascade's stage 3: True or False when a cheap comparison settles it, None when only a verifier can.

    Equal after normalize_answer: True. Both plain integers: their values decide ("072" passes for
    "72", "71" fails). No answer or no reference answer: False. Anything else (fractions, decimals,
    expressions, leftovers such as "9>") is None: math-verify reads those, and a cheap rule could
    disagree with it.
    """
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    ip, ig = _integer(p), _integer(g)
    return None if ip is None or ig is None else ip == ig


def score_one(problem, completion: str) -> float:
    """1.0 if the answer extracted from `completion` (by problem.task) matches problem.answer, else 0.0.

    A match is what cheap_verdict calls True (equal after normalize_answer, or equal integers); a
    completion with no extractable answer scores 0.0. The cheap path only (no math-verify, no sandbox):
    what the Cascade below would send to math-verify scores 0 here.
    """
    pred = extract_answer(problem.task, completion if isinstance(completion, str) else "")
    return 1.0 if pred is not None and cheap_verdict(pred, problem.answer) else 0.0


def score(problems: Sequence, completions: Sequence[str]) -> list[float]:
    """score_one over aligned lists (one completion per problem; repeat problems for a GRPO group)."""
    if len(problems) != len(completions):
        raise ValueError(f"score: {len(problems)} problems but {len(completions)} completions")
    return [score_one(p, c) for p, c in zip(problems, completions)]


# ---------------------------------------------------------------------------------------------
# Calls with a deadline: a thread for the judge, a worker process for math-verify.

STAGES = ("dedup", "cheap", "exact", "verify", "judge")
MATH_VERIFY_TASKS = ("gsm8k", "math", "synthetic")  # answers that stage 3 cannot settle go on to math-verify


def _call_with_timeout(fn: Callable, args: tuple, timeout_s: float) -> tuple:
    """(value, "ok"), (None, "timeout") or (None, "error: ...") for fn(*args), run in a daemon thread.

    At the deadline the thread is abandoned, not killed (threads cannot be); it never blocks exit.
    """
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # SystemExit from a user judge too: it must not end the trainer
            box["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, daemon=True, name="zeros-reward-call")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return None, "timeout"
    if "error" in box:
        return None, "error: " + box["error"]
    return box.get("value"), "ok"


def _parallel(fn: Callable, items: list, workers: int) -> list:
    """[fn(x) for x in items] on up to `workers` threads; fn must not raise."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="zeros-reward") as ex:
        return list(ex.map(fn, items))


class _MathWorker:
    """One math-verify process (`python reward.py --math-worker ...`), spoken to in JSON lines.

    A call past its deadline kills the process and the next call starts a fresh one (about a
    second: importing sympy). A worker that dies (e.g. on its memory cap) is restarted the same way.
    """

    def __init__(self, mem_mb: int, timeout_s: float):
        self.mem_mb, self.timeout_s, self.proc = int(mem_mb), float(timeout_s), None

    def _start(self) -> None:
        alarm_s = math.ceil(self.timeout_s) + 1  # the worker's own alarm fires after our deadline
        here = os.path.abspath(__file__)
        self.proc = subprocess.Popen(
            [sys.executable, here, "--math-worker", str(self.mem_mb), str(alarm_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=os.path.dirname(here))
        ready = self._read(time.monotonic() + 120)  # the first import can be slow on a busy machine
        if ready != {"ready": True}:
            self.kill()
            raise RuntimeError(f"the math-verify worker did not start: {ready}")

    def _read(self, deadline: float) -> Optional[dict]:
        """The next reply, or None at the deadline or at EOF. A reply is one small write (atomic on
        a pipe), so once select says the pipe is readable, the whole line is there."""
        out = self.proc.stdout
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([out], [], [], left)[0]:
            return None
        line = out.readline()
        return json.loads(line) if line else None

    def check(self, gold: str, pred: str) -> tuple:
        """(equal, "ok"), (None, "timeout") or (None, "error: ...")."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            self.proc.stdin.write((json.dumps({"gold": gold, "pred": pred}) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read(time.monotonic() + self.timeout_s)
        except (OSError, RuntimeError, ValueError) as e:
            self.kill()
            return None, f"error: math-verify worker: {e}"
        if reply is None:
            hung = self.proc.poll() is None
            self.kill()
            return (None, "timeout") if hung else (None, "error: the math-verify worker died")
        if "error" in reply:
            return None, f"error: math-verify: {reply['error']}"
        return bool(reply.get("equal")), "ok"

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()


def _math_worker(mem_mb: int, alarm_s: int) -> None:
    """The worker's loop: one request {"gold", "pred"} per line in, one reply per line out."""
    import functools
    import resource

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library that prints writes to stderr, never into the replies

    def send(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))  # 10^{10^{10}} ends in MemoryError
    try:
        import logging

        from math_verify import parse, verify
        logging.disable(logging.WARNING)  # math-verify logs every parse failure
    except Exception as e:
        return send({"ready": False, "error": f"{type(e).__name__}: {e}"})
    parse_gold = functools.lru_cache(maxsize=4096)(lambda s: parse(f"${s}$", parsing_timeout=alarm_s))
    send({"ready": True})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            gold, pred = parse_gold(req["gold"]), parse(f"${req['pred']}$", parsing_timeout=alarm_s)
            send({"equal": bool(gold and pred and verify(gold, pred, timeout_seconds=alarm_s))})
        except BaseException as e:  # MemoryError included: report it and take the next request
            send({"error": f"{type(e).__name__}: {e}"[:300]})


# ---------------------------------------------------------------------------------------------
# The cascade.

@dataclass
class RewardResult:
    """What the cascade decided for one batch. Lists are per completion, dicts per stage."""
    rewards: list  # float per completion
    stages: list   # the stage (one of STAGES) that decided it
    cost_s: list   # seconds of its deciding call (0 for the cheap stages)
    reached: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0))  # completions each stage looked at
    time_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))  # wall seconds of each stage
    by_value: int = 0         # answers that failed the string match but were settled as integers (stage 3)
    dedup_saved: int = 0      # copies that took the reward of their first occurrence
    saved_expensive: int = 0  # ... of which would have reached verify or judge
    cheap_fail: Counter = field(default_factory=Counter)   # reason -> count
    code_status: Counter = field(default_factory=Counter)  # sandbox status -> count
    errors: int = 0
    timeouts: int = 0
    notes: list = field(default_factory=list)  # the first error and timeout messages

    def summary(self) -> dict:
        """Short keys for the log line: fractions of all completions, counts, seconds."""
        n = max(1, len(self.rewards))
        out = {f"reach_{s}": self.reached[s] / n for s in ("exact", "verify", "judge")}
        out.update(cheap_fail=sum(self.cheap_fail.values()) / n, by_value=self.by_value / n,
                   dedup_saved=self.dedup_saved / n, errors=self.errors, timeouts=self.timeouts,
                   t_verify=self.time_s["verify"], t_judge=self.time_s["judge"], t_reward=sum(self.time_s.values()))
        return out


def combine(results: Sequence[RewardResult]) -> RewardResult:
    """One RewardResult from several, in order (e.g. the refills of dynamic sampling in one step)."""
    out = RewardResult([], [], [])
    for r in results:
        for f in fields(RewardResult):  # lists concatenate, counts add, per-stage dicts add by key
            a, b = getattr(out, f.name), getattr(r, f.name)
            setattr(out, f.name, {k: a[k] + b[k] for k in a} if type(a) is dict else a + b)
    out.notes = out.notes[:10]
    return out


class Cascade:
    """The verifier cascade (see the module docstring). It owns the math-verify worker processes:
    close() it when done, or use it in a `with` block.

    max_chars: longer completions fail the cheap checks (None: no limit). math_verify: False lets
    stage 3 alone decide math, gsm8k and synthetic (what it cannot settle scores 0). verify_timeout_s,
    verify_workers, verify_mem_mb: the deadline of one math-verify call, the number of worker
    processes, the memory cap of each.
    code_limits: sandbox limits (run_tests keywords); code_workers: sandbox runs at a time.
    judge, judge_on ("rejected" or "passed"), judge_timeout_s, judge_workers: see stage 5.
    """

    def __init__(self, max_chars: Optional[int] = None, math_verify: bool = True, verify_timeout_s: float = 5.0,
                 verify_workers: int = 1, verify_mem_mb: int = 2048, code_limits: Optional[dict] = None,
                 code_workers: int = 4, judge: Optional[Callable] = None, judge_on: str = "rejected",
                 judge_timeout_s: float = 30.0, judge_workers: int = 4):
        numbers = (("max_chars", 1 if max_chars is None else max_chars, int), ("verify_workers", verify_workers, int),
                   ("verify_mem_mb", verify_mem_mb, int), ("code_workers", code_workers, int),
                   ("judge_workers", judge_workers, int), ("verify_timeout_s", verify_timeout_s, (int, float)),
                   ("judge_timeout_s", judge_timeout_s, (int, float)))
        for name, v, kinds in numbers:
            if isinstance(v, bool) or not isinstance(v, kinds) or not v > 0:
                kind = "int" if kinds is int else "number"
                raise ValueError(f"Cascade: {name} must be a positive {kind}, got {v!r}")
        unknown = set(code_limits or {}) - set(inspect.signature(run_program).parameters) - {"code", "tests"}
        if unknown:
            raise ValueError(f"Cascade: unknown code_limits keys {sorted(unknown)}; see sandbox.run_program")
        if judge_on not in ("rejected", "passed"):
            raise ValueError(f"Cascade: judge_on must be 'rejected' or 'passed', got {judge_on!r}")
        if judge is not None and not callable(judge):
            raise TypeError(f"Cascade: judge must be a callable (prompt, completion, reference) -> float, "
                            f"got {judge!r}")
        if math_verify and importlib.util.find_spec("math_verify") is None:
            raise ImportError("Cascade: math_verify=True needs the math-verify package (pip install math-verify)")
        self.max_chars, self.math_verify, self.judge, self.judge_on = max_chars, bool(math_verify), judge, judge_on
        self.judge_timeout_s, self.judge_workers = float(judge_timeout_s), judge_workers
        self.code_workers = code_workers
        self.code_limits = {"timeout_s": 5.0, "cpu_s": 5, "mem_mb": 512, **(code_limits or {})}
        self._workers = [_MathWorker(verify_mem_mb, verify_timeout_s) for _ in range(verify_workers)]
        self._idle: Queue = Queue()  # a verify thread takes a worker, uses it alone, gives it back
        for w in self._workers:
            self._idle.put(w)

    def close(self) -> None:
        for w in self._workers:
            w.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def score_batch(self, problems: Sequence, completions: Sequence[str], group_size: int = 1) -> RewardResult:
        """Rewards for aligned lists: completion i answers problems[i], and each group (one prompt's
        completions) sits together, group_size in a row. Raises only on bad arguments."""
        n = len(completions)
        if len(problems) != n:
            raise ValueError(f"score_batch: {len(problems)} problems but {n} completions")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or n % group_size:
            raise ValueError(f"score_batch: group_size must be an int >= 1 that divides {n}, got {group_size!r}")
        self._check_problems(problems)
        texts = [c if isinstance(c, str) else "" for c in completions]
        res = RewardResult([0.0] * n, [""] * n, [0.0] * n)
        t = [time.perf_counter()]

        def lap(stage):
            t.append(time.perf_counter())
            res.time_s[stage] = t[-1] - t[-2]

        first = {}  # stage 1: (group, problem, text) -> its first completion
        rep = [first.setdefault((i // group_size, id(problems[i]), s), i) for i, s in enumerate(texts)]
        res.reached["dedup"], res.dedup_saved = n, sum(j != i for i, j in enumerate(rep))
        lap("dedup")
        preds = self._cheap(problems, texts, [i for i in range(n) if rep[i] == i], res)
        lap("cheap")
        to_verify, to_judge = self._exact(problems, preds, res)
        lap("exact")
        self._verify(problems, preds, to_verify, to_judge, res)
        lap("verify")
        self._judge(problems, texts, to_judge, res)
        lap("judge")
        for i, j in enumerate(rep):
            if j != i:
                res.rewards[i], res.stages[i] = res.rewards[j], "dedup"
                res.saved_expensive += res.stages[j] in ("verify", "judge")
        return res

    def _check_problems(self, problems: Sequence) -> None:
        for k, p in enumerate(problems):
            task = getattr(p, "task", None)
            if task == "code" and not (isinstance(p.meta.get("test_list"), (list, tuple)) and p.meta["test_list"]):
                raise ValueError(f"score_batch: code problem {k} has no meta['test_list'] for the sandbox to run")
            if task != "code" and task not in EXTRACTORS and self.judge is None:
                raise ValueError(f"score_batch: problem {k} has task {task!r}, which has no verifier "
                                 f"(known: {sorted(EXTRACTORS) + ['code']}); give the Cascade a judge to score it")

    def _cheap(self, problems, texts, todo, res) -> dict:
        """Stage 2: {i: extracted answer (code: the code)} for the completions that pass; the rest score 0."""
        preds = {}
        for i in todo:
            res.reached["cheap"] += 1
            try:
                why, pred = self._cheap_one(problems[i], texts[i])
            except Exception as e:  # a bug in an extractor must not stop the loop
                why, pred = "error", None
                self._count(res, f"error: {type(e).__name__}: {e}", "cheap")
            if why:
                res.cheap_fail[why] += 1
                res.stages[i] = "cheap"
            else:
                preds[i] = pred
        return preds

    def _cheap_one(self, problem, text: str) -> tuple:
        """(the reason it fails, None) or (None, the extracted answer or code)."""
        if not text.strip():
            return "empty", None
        if self.max_chars is not None and len(text) > self.max_chars:
            return "too_long", None
        if problem.task == "code":
            if "```" not in text:
                return "no_code_block", None
            code = extract_code(text)
            try:
                ast.parse(code)
            except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte
                return "syntax", None
            return None, code
        if problem.task not in EXTRACTORS:
            return None, text  # a judge-only task: the judge reads the whole completion
        pred = EXTRACTORS[problem.task](text)
        if pred is None:
            return "no_answer", None
        return ("empty_answer", None) if normalize_answer(pred) == "" else (None, pred)

    def _exact(self, problems, preds, res) -> tuple:
        """Stage 3: cheap_verdict settles the clear cases. Returns (indices to verify, indices to judge)."""
        to_verify, to_judge = [], []
        for i, pred in preds.items():
            p = problems[i]
            if p.task == "code" or p.task not in EXTRACTORS:  # no answer to match: verify or judge it
                (to_verify if p.task == "code" else to_judge).append(i)
                continue
            res.reached["exact"] += 1
            verdict = cheap_verdict(pred, p.answer)
            if verdict is None and self.math_verify and p.task in MATH_VERIFY_TASKS:
                to_verify.append(i)
                continue
            gold = normalize_answer(p.answer)  # settled here; or not, with math_verify off: that scores 0
            res.by_value += verdict is not None and gold != "" and normalize_answer(pred) != gold
            self._settle(res, i, "exact", float(bool(verdict)), to_judge)
        return to_verify, to_judge

    def _settle(self, res, i, stage, reward, to_judge, cost=0.0) -> None:
        """A verdict; it goes on to the judge if the judge looks at verdicts of that kind."""
        res.rewards[i], res.stages[i], res.cost_s[i] = reward, stage, cost
        if self.judge is not None and (reward > 0) == (self.judge_on == "passed"):
            to_judge.append(i)

    def _verify(self, problems, preds, idx, to_judge, res) -> None:
        """Stage 4, on threads: math-verify for math and gsm8k, the tests in the sandbox for code."""
        res.reached["verify"] += len(idx)
        threads = max(self.code_workers, len(self._workers))
        outs = _parallel(lambda i: self._verify_one(problems[i], preds[i]), idx, threads)
        for i, (reward, status, cost, sandbox_status) in zip(idx, outs):
            self._count(res, status, "verify")
            res.code_status.update([sandbox_status] if sandbox_status else [])
            self._settle(res, i, "verify", reward, to_judge, cost)

    def _verify_one(self, problem, pred: str) -> tuple:
        """(reward, "ok" | "timeout" | "error: ...", seconds, sandbox status or None); never raises."""
        t = time.perf_counter()
        try:
            if problem.task == "code":
                m = problem.meta
                r = run_tests(pred, list(m["test_list"]), m.get("test_setup_code") or "", **self.code_limits)
                status = f"error: sandbox: {r.stderr.strip()[-200:]}" if r.status == "error" else "ok"
                return float(r.passed), status, time.perf_counter() - t, r.status
            worker = self._idle.get()
            try:
                equal, status = worker.check(str(problem.answer), pred)
            finally:
                self._idle.put(worker)
            return float(bool(equal)), status, time.perf_counter() - t, None
        except Exception as e:
            return 0.0, f"error: {type(e).__name__}: {e}", time.perf_counter() - t, None

    def _judge(self, problems, texts, idx, res) -> None:
        """Stage 5: the user's judge, on threads, each call with a deadline; a failed call scores 0."""
        res.reached["judge"] += len(idx)

        def one(i):
            t, p = time.perf_counter(), problems[i]
            value, status = _call_with_timeout(self.judge, (p.prompt, texts[i], p.answer), self.judge_timeout_s)
            if status == "ok" and not (isinstance(value, (int, float)) and math.isfinite(value)):
                status = f"error: the judge returned {value!r}, not a finite number"
            return (float(value) if status == "ok" else 0.0), status, time.perf_counter() - t

        for i, (reward, status, cost) in zip(idx, _parallel(one, idx, self.judge_workers)):
            self._count(res, status, "judge")
            res.rewards[i], res.stages[i], res.cost_s[i] = reward, "judge", cost

    @staticmethod
    def _count(res, status: str, stage: str) -> None:
        """Count a failed call (a timeout or an error) and keep its message for the log."""
        if status != "ok":
            res.timeouts += status == "timeout"
            res.errors += status != "timeout"
            res.notes += [f"{stage}: {status}"][:10 - len(res.notes)]


def load_judge(spec: str) -> Optional[Callable]:
    """'module:function' -> the callable, imported by name (the user's own file; nothing is registered).
    Empty: no judge."""
    if not spec:
        return None
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"config key 'judge': cannot import {spec!r} ({e})") from None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--math-worker"]:
        sys.exit(_math_worker(int(sys.argv[2]), int(sys.argv[3])))
    half = Problem("What is 1/2 of 1?", r"\frac{1}{2}", "math")
    add = Problem("Write add(a, b).", "def add(a, b): return a + b", "code", {"test_list": ["assert add(1, 2) == 3"]})
    batch = [(half, r"so \boxed{\frac{1}{2}}"), (half, r"so \boxed{\frac{1}{2}}"), (half, r"so \boxed{0.5}"),
             (half, "I give up"), (add, "```python\ndef add(a, b): return a + b\n```"),
             (add, "```python\ndef add(a, b): return a - b\n```"), (add, "```python\ndef add(a, b)\n```"),
             (add, "def add(a, b): return a + b  (no code block)")]
    with Cascade(max_chars=4000) as cascade:  # two groups of four completions
        res = cascade.score_batch([p for p, _ in batch], [c for _, c in batch], group_size=4)
    for (_, text), r, s in zip(batch, res.rewards, res.stages):
        print(f"{r:.1f}  {s:<7} {text!r:.70}")
    print({k: round(v, 3) for k, v in res.summary().items()})
