"""Rewards for GRPO (stage 3): the verifier cascade. Cheap checks first; most completions end in a
zero.

A completion goes down the stages and stops at the first that decides it, so the expensive stages
see only what the cheap ones let through:
    1 dedup   identical completions (same text, same finish) within a group are scored once; the
              copies get the same reward
    2 cheap   a completion cut at max_new_tokens (finish "length") scores 0, counted as truncated.
              Else an answer is extractable and non-empty (code: a ```python block that
              ast.parse accepts), at most max_chars long. A failure scores 0 and stops
    3 exact   answers.cheap_verdict: equal after normalize_answer, plain numbers by exact value
              (072 = 72, .5 = 1/2 = \\frac{1}{2}, 0.333333 != 1/3), a decimal approximation of a
              symbolic reference fails (1.41421356 for \\sqrt{2}). What it settles stops here.
              reasoning-gym: the answer equal to the reference (stripped) scores 1 here, as every
              generator's own scorer gives its reference; anything else goes on to stage 4
    4 verify  math-verify symbolic equivalence for math and gsm8k answers (\\frac{\\sqrt{2}}{2} =
              \\frac{1}{\\sqrt{2}}); the unit tests in the sandbox (sandbox.py) for code; for
              reasoning-gym the library's own score_answer(answer, item), the last stage: a
              countdown expression that makes the target another way scores 1, and its partial
              credit stays (countdown 0.05 for an expression that misses, gsm_symbolic 0.01)
    5 judge   optional, a callable (prompt, completion, reference) -> float (a small model, a user
              function): a second look at what was rejected (judge_on="rejected") or a grade for
              what passed ("passed"); tasks with no verifier go to it directly
`Cascade.score_batch` returns a RewardResult: per completion the reward (a finite float), the stage
that decided it and that call's seconds; per stage the completions that reached it and its time;
the truncated, errors and timeouts. `summary()` gives the short dict for the log line. A verifier
or judge that raises, hangs or returns a non-number gives 0, is counted, and never stops the loop:
math-verify and reasoning-gym's scorers run in a worker process killed at its deadline (math-verify
hangs for good on 10^{10^{10^{10}}}, countdown's scorer on 9**9**9**9), the judge on a fixed pool
of judge_workers threads; a judge score that is not finite or beyond +-1e6 (1e39 is inf in
float32) is an error. `overlong_penalty` is DAPO's soft
overlong punishment, for the loop to add to the rewards.

Simplifications:
  1. Dedup matches exact text within a group; near-duplicates are scored separately.
  2. Credit needs the task's answer marker: a gsm8k completion without "####" scores 0, here and
     in score_one (no fallback to the last number). A truncated completion scores 0, whatever
     it says.
  3. Code scores 1 only if every assert of test_list passes (no partial credit); MBPP's challenge
     tests stay in meta, unused.
  4. A judge call past its deadline is abandoned, not killed (threads cannot be): its thread
     stays busy until the judge returns, and no thread is added for it; while all judge_workers
     threads are stuck, judge calls score 0 at once and count as timeouts.
  5. A math-verify worker stuck when the trainer dies lives on until its memory cap or its alarm.
  6. `score` / `score_one` are the cheap path alone (stage 3, no processes) for quick checks.
  7. Stage 3 settles plain numbers by exact value, and fails a decimal approximation of a
     symbolic reference, because math-verify rounds (it calls 0.333333 and 1/3, 1.41421356 and
     \\sqrt{2} equal); what stage 3 leaves to math-verify (expressions) keeps that rounding.
  8. reasoning-gym's scorers are not all pure: countdown's reads the answer with sympy's
     parse_expr, which evaluates it as Python. So they run in the verify worker (answers.py), with
     math-verify's deadline and memory cap, and it may write no file (RLIMIT_FSIZE 0); it is not
     a sandbox: it runs as our user. Stage 3 settles only an answer equal to the reference: a
     wrong number goes on to the scorer too, which may give partial credit.

    with Cascade(max_chars=8000) as cascade:
        res = cascade.score_batch(problems, completions, group_size=8, finish=ro.finish)
    res.rewards, res.stages, res.summary()  # {"reach_exact": .., "truncated": .., ...}
    overlong_penalty([80, 90, 100], max_new_tokens=100, buffer=20)  # [0.0, -0.5, -1.0]

`python reward.py` scores a small hand-made batch and prints what decided each completion.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import math
import numbers
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from queue import Queue
from typing import Callable, Optional, Sequence

from sandbox import extract_code, run_program, run_tests
from answers import (EXTRACTORS, VerifyWorker, cheap_verdict, extract_answer,  # noqa: F401
                     normalize_answer)
from tasks import Problem

JUDGE_MAX = 1e6  # a judge score beyond +-JUDGE_MAX (or not finite) is a fault, not a reward


def score_one(problem, completion: str) -> float:
    """1.0 if the answer extracted from `completion` (by problem.task) is one that cheap_verdict
    calls equal to problem.answer, else 0.0 (no answer, e.g. a gsm8k one without "####", too).
    The cheap path only (no math-verify, no sandbox): what the Cascade below would send to
    math-verify scores 0 here."""
    pred = extract_answer(problem.task, completion if isinstance(completion, str) else "")
    if problem.task == RG_TASK:  # stage 3's rule for reasoning-gym: the reference itself
        return 1.0 if pred is not None and pred.strip() == problem.answer.strip() else 0.0
    return 1.0 if pred is not None and cheap_verdict(pred, problem.answer) else 0.0


def score(problems: Sequence, completions: Sequence[str]) -> list[float]:
    """score_one over aligned lists (one completion per problem; repeat problems for a group)."""
    if len(problems) != len(completions):
        raise ValueError(f"score: {len(problems)} problems but {len(completions)} completions")
    return [score_one(p, c) for p, c in zip(problems, completions)]


def overlong_penalty(lengths: Sequence[int], max_new_tokens: int, buffer: int,
                     penalty: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment: one value per completion length (in tokens), to add to
    its reward.

    0 while L <= max_new_tokens - buffer; then -penalty * (L - (max_new_tokens - buffer)) / buffer,
    a ramp down to -penalty at L = max_new_tokens (and -penalty past it). buffer 0: all zeros.
    overlong_penalty([80, 90, 100], 100, 20) -> [0.0, -0.5, -1.0].
    """
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (max_new_tokens, buffer))
    if not (ints and 0 <= buffer <= max_new_tokens and max_new_tokens >= 1):
        raise ValueError(f"overlong_penalty: needs ints 0 <= buffer <= max_new_tokens, got "
                         f"buffer={buffer!r}, max_new_tokens={max_new_tokens!r}")
    if not (isinstance(penalty, (int, float)) and math.isfinite(penalty) and penalty >= 0):
        raise ValueError(f"overlong_penalty: penalty must be a finite number >= 0, got {penalty!r}")
    if buffer == 0:
        return [0.0] * len(lengths)
    start = max_new_tokens - buffer
    return [-penalty * min(n - start, buffer) / buffer if n > start else 0.0
            for n in map(int, lengths)]


# ---------------------------------------------------------------------------------------------
# Calls with a deadline: a fixed pool of threads for the judge; the worker processes of math-verify
# and reasoning-gym's scorers are answers.VerifyWorker.

STAGES = ("dedup", "cheap", "exact", "verify", "judge")
MATH_VERIFY_TASKS = ("gsm8k", "math")  # answers that stage 3 cannot settle go on to math-verify
RG_TASK = "reasoning_gym"  # ... and reasoning-gym's to the library's scorer


def _real(x) -> float:
    """x as a float; NaN for anything that is not a real number (a string, None, 10**400)."""
    try:
        return float(x) if isinstance(x, numbers.Real) else math.nan
    except (OverflowError, ValueError, TypeError):
        return math.nan


def _judge_score(value) -> tuple:
    """(the judge's score as a float, "ok"), or (0.0, "error: ...") for anything but a real
    number within +-JUDGE_MAX."""
    if math.isfinite(v := _real(value)) and abs(v) <= JUDGE_MAX:
        return v, "ok"
    return 0.0, f"error: the judge returned {value!r:.60}, not a finite number within +-1e6"


class _JudgeCall:
    __slots__ = ("args", "start", "out", "cost", "late")

    def __init__(self, args: tuple):
        self.args, self.start, self.out, self.cost, self.late = args, None, None, 0.0, False


class _JudgePool:
    """`workers` threads that run the judge, started once and reused. A call's deadline counts
    from when a worker takes it. Past it the call is a timeout and is abandoned: its worker stays
    stuck until the judge returns, then serves again. While every worker is stuck, waiting calls
    are timeouts at once. So a judge that hangs for good holds `workers` threads, never more."""

    def __init__(self, fn: Callable, workers: int, timeout_s: float):
        self.fn, self.workers, self.timeout_s = fn, workers, timeout_s
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._threads: list = []  # the live workers; one leaves the list as it exits
        self._stuck, self._closed = 0, False  # _stuck: workers busy with a call already timed out

    def map(self, args_list: Sequence[tuple]) -> list:
        """[(value, status, seconds)] per call; status "ok", "timeout" or "error: ..."."""
        calls = [_JudgeCall(a) for a in args_list]
        with self._cv:
            self._closed = False
            while len(self._threads) < self.workers:
                t = threading.Thread(target=self._serve, daemon=True, name="zeros-judge")
                self._threads.append(t)
                t.start()
            self._queue.extend(calls)
            self._cv.notify_all()
            while True:
                wait_s = self._expire(calls)
                if all(c.out is not None for c in calls):
                    return [c.out + (c.cost,) for c in calls]
                self._cv.wait(self.timeout_s if wait_s is None else wait_s)

    def _expire(self, calls: list) -> Optional[float]:
        """Time out the calls past their deadline; seconds to the next deadline (None: none)."""
        now, wait_s = time.monotonic(), None
        for c in calls:
            if c.out is None and c.start is not None:
                left = c.start + self.timeout_s - now
                if left > 0:
                    wait_s = left if wait_s is None else min(wait_s, left)
                    continue
                c.out, c.cost, c.late = (None, "timeout"), now - c.start, True
                self._stuck += 1
        if self._stuck >= self.workers:  # no worker left to take what waits: time it out now
            for c in calls:
                if c.out is None and c.start is None:
                    self._queue.remove(c)
                    c.out = (None, "timeout")
        return wait_s

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    self._threads.remove(threading.current_thread())
                    return
                call = self._queue.popleft()
                call.start = time.monotonic()
                self._cv.notify_all()  # its caller now waits on its deadline
            try:
                out = (self.fn(*call.args), "ok")
            except BaseException as e:  # SystemExit from a user judge too: the trainer goes on
                out = (None, f"error: {type(e).__name__}: {e}")
            with self._cv:
                if call.late:
                    self._stuck -= 1
                else:
                    call.out, call.cost = out, time.monotonic() - call.start
                self._cv.notify_all()

    def close(self) -> None:
        """Idle workers exit; a stuck one exits when its call returns."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def _parallel(fn: Callable, items: list, workers: int) -> list:
    """[fn(x) for x in items] on up to `workers` threads; fn must not raise."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="zeros-reward") as ex:
        return list(ex.map(fn, items))


# ---------------------------------------------------------------------------------------------
# The cascade.

@dataclass
class RewardResult:
    """What the cascade decided for one batch. Lists are per completion, dicts per stage
    (`reached`: the completions it looked at; `time_s`: its wall seconds)."""
    rewards: list  # float per completion, always finite
    stages: list   # the stage (one of STAGES) that decided it
    cost_s: list   # seconds of its deciding call (0 for the cheap stages)
    reached: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    time_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    by_value: int = 0         # answers that failed the string match but were settled in stage 3
    dedup_saved: int = 0      # copies that took the reward of their first occurrence
    saved_expensive: int = 0  # ... of which would have reached verify or judge
    truncated: int = 0        # cut at max_new_tokens (finish "length"): 0 in stage 2
    cheap_fail: Counter = field(default_factory=Counter)   # reason -> count
    code_status: Counter = field(default_factory=Counter)  # sandbox status -> count
    errors: int = 0
    timeouts: int = 0
    notes: list = field(default_factory=list)  # the first error and timeout messages

    def summary(self) -> dict:
        """Short keys for the log line: fractions of all completions (reach_*, cheap_fail,
        by_value, dedup_saved), counts (truncated, errors, timeouts), seconds (t_*)."""
        n = max(1, len(self.rewards))
        out = {f"reach_{s}": self.reached[s] / n for s in ("exact", "verify", "judge")}
        out.update(cheap_fail=sum(self.cheap_fail.values()) / n, by_value=self.by_value / n,
                   dedup_saved=self.dedup_saved / n, truncated=self.truncated, errors=self.errors,
                   timeouts=self.timeouts, t_verify=self.time_s["verify"],
                   t_judge=self.time_s["judge"], t_reward=sum(self.time_s.values()))
        return out


def combine(results: Sequence[RewardResult]) -> RewardResult:
    """One RewardResult from several, in order (e.g. the refills of dynamic sampling)."""
    out = RewardResult([], [], [])
    for r in results:
        for f in fields(RewardResult):  # lists concatenate, counts add, per-stage dicts add by key
            a, b = getattr(out, f.name), getattr(r, f.name)
            setattr(out, f.name, {k: a[k] + b[k] for k in a} if type(a) is dict else a + b)
    out.notes = out.notes[:10]
    return out


class Cascade:
    """The verifier cascade (see the module docstring). It owns the math-verify worker processes
    and the judge's threads: close() it when done, or use it in a `with` block.

    max_chars: longer completions fail the cheap checks (None: no limit). math_verify: False lets
    stage 3 alone decide math and gsm8k (what it cannot settle scores 0); reasoning-gym's scorers
    run either way. verify_timeout_s, verify_workers, verify_mem_mb: the deadline of one
    math-verify or reasoning-gym call, the number of worker processes, the memory cap of each.
    code_limits: sandbox limits (run_tests keywords); code_workers: sandbox runs at a time.
    judge, judge_on ("rejected" or "passed"), judge_timeout_s (the deadline of one call),
    judge_workers (the judge's threads, all it will ever use): see stage 5.
    """

    def __init__(self, max_chars: Optional[int] = None, math_verify: bool = True,
                 verify_timeout_s: float = 5.0, verify_workers: int = 1, verify_mem_mb: int = 2048,
                 code_limits: Optional[dict] = None, code_workers: int = 4,
                 judge: Optional[Callable] = None, judge_on: str = "rejected",
                 judge_timeout_s: float = 30.0, judge_workers: int = 4):
        checks = (("max_chars", 1 if max_chars is None else max_chars, int),
                  ("verify_workers", verify_workers, int), ("verify_mem_mb", verify_mem_mb, int),
                  ("code_workers", code_workers, int), ("judge_workers", judge_workers, int),
                  ("verify_timeout_s", verify_timeout_s, (int, float)),
                  ("judge_timeout_s", judge_timeout_s, (int, float)))
        for name, v, kinds in checks:
            if isinstance(v, bool) or not isinstance(v, kinds) or not v > 0:
                kind = "int" if kinds is int else "number"
                raise ValueError(f"Cascade: {name} must be a positive {kind}, got {v!r}")
        known = set(inspect.signature(run_program).parameters) | {"code", "tests"}
        unknown = set(code_limits or {}) - known
        if unknown:
            raise ValueError(f"Cascade: unknown code_limits keys {sorted(unknown)}; "
                             f"see sandbox.run_program")
        if judge_on not in ("rejected", "passed"):
            raise ValueError(f"Cascade: judge_on must be 'rejected' or 'passed', got {judge_on!r}")
        if judge is not None and not callable(judge):
            raise TypeError(f"Cascade: judge must be a callable (prompt, completion, reference) "
                            f"-> float, got {judge!r}")
        if math_verify and importlib.util.find_spec("math_verify") is None:
            raise ImportError("Cascade: math_verify=True needs the math-verify package "
                              "(pip install math-verify)")
        self.max_chars, self.math_verify = max_chars, bool(math_verify)
        self.judge, self.judge_on = judge, judge_on
        self.judge_timeout_s, self.judge_workers = float(judge_timeout_s), judge_workers
        self._judges = _JudgePool(judge, judge_workers, self.judge_timeout_s) if judge else None
        self.code_workers = code_workers
        self.code_limits = {"timeout_s": 5.0, "cpu_s": 5, "mem_mb": 512, **(code_limits or {})}
        self._workers = [VerifyWorker(verify_mem_mb, verify_timeout_s)
                         for _ in range(verify_workers)]
        self._idle: Queue = Queue()  # a verify thread takes a worker, uses it alone, gives it back
        for w in self._workers:
            self._idle.put(w)

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        if self._judges is not None:
            self._judges.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def score_batch(self, problems: Sequence, completions: Sequence[str], group_size: int = 1,
                    finish: Optional[Sequence[str]] = None) -> RewardResult:
        """Rewards for aligned lists: completion i answers problems[i], and each group (one
        prompt's completions) sits together, group_size in a row. `finish`: the rollout's finish
        reason per completion ("stop", "eos", "length"); a "length" row (cut at max_new_tokens)
        scores 0 in stage 2. Raises only on bad arguments."""
        n = len(completions)
        if len(problems) != n:
            raise ValueError(f"score_batch: {len(problems)} problems but {n} completions")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 \
                or n % group_size:
            raise ValueError(f"score_batch: group_size must be an int >= 1 that divides {n}, "
                             f"got {group_size!r}")
        if finish is not None and (isinstance(finish, str) or len(finish) != n):
            raise ValueError(f"score_batch: finish must be one reason per completion ({n}), "
                             f"got {finish!r:.80}")
        self._check_problems(problems)
        texts = [c if isinstance(c, str) else "" for c in completions]
        cut = [False] * n if finish is None else [f == "length" for f in finish]
        res = RewardResult([0.0] * n, [""] * n, [0.0] * n)
        t = [time.perf_counter()]

        def lap(stage):
            t.append(time.perf_counter())
            res.time_s[stage] = t[-1] - t[-2]

        first = {}  # stage 1: (group, problem, text, cut) -> its first completion
        rep = [first.setdefault((i // group_size, id(problems[i]), s, cut[i]), i)
               for i, s in enumerate(texts)]
        todo = [i for i in range(n) if rep[i] == i]
        res.reached["dedup"], res.dedup_saved = n, n - len(todo)
        lap("dedup")
        preds = self._cheap(problems, texts, cut, todo, res)
        lap("cheap")
        to_verify, to_judge = self._exact(problems, preds, res)
        lap("exact")
        self._verify(problems, preds, to_verify, to_judge, res)
        lap("verify")
        self._judge(problems, texts, to_judge, res)
        lap("judge")
        self._finite(res, todo)
        for i, j in enumerate(rep):
            if j != i:
                res.rewards[i], res.stages[i] = res.rewards[j], "dedup"
                res.saved_expensive += res.stages[j] in ("verify", "judge")
        return res

    def _check_problems(self, problems: Sequence) -> None:
        for k, p in enumerate(problems):
            task = getattr(p, "task", None)
            tests = p.meta.get("test_list") if task == "code" else None
            if task == "code" and not (isinstance(tests, (list, tuple)) and tests):
                raise ValueError(f"score_batch: code problem {k} has no meta['test_list'] for "
                                 f"the sandbox to run")
            if task != "code" and task not in EXTRACTORS and self.judge is None:
                raise ValueError(f"score_batch: problem {k} has task {task!r}, which has no "
                                 f"verifier (known: {sorted(EXTRACTORS) + ['code']}); give the "
                                 f"Cascade a judge to score it")

    def _cheap(self, problems, texts, cut, todo, res) -> dict:
        """Stage 2: {i: extracted answer (code: the code)} for the completions that pass; the
        rest score 0, the truncated ones first of all."""
        preds = {}
        for i in todo:
            res.reached["cheap"] += 1
            if cut[i]:  # cut at max_new_tokens: no credit, whatever it says
                res.truncated += 1
                res.stages[i] = "cheap"
                continue
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
            except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: NUL
                return "syntax", None
            return None, code
        if problem.task not in EXTRACTORS:
            return None, text  # a judge-only task: the judge reads the whole completion
        pred = EXTRACTORS[problem.task](text)
        if pred is None:
            return "no_answer", None
        return ("empty_answer", None) if normalize_answer(pred) == "" else (None, pred)

    def _exact(self, problems, preds, res) -> tuple:
        """Stage 3: cheap_verdict settles the clear cases. -> (indices to verify, to judge)."""
        to_verify, to_judge = [], []
        for i, pred in preds.items():
            p = problems[i]
            if p.task == "code" or p.task not in EXTRACTORS:  # no answer to match
                (to_verify if p.task == "code" else to_judge).append(i)
                continue
            res.reached["exact"] += 1
            if p.task == RG_TASK:  # its reference scores 1; the rest only its scorer can say
                if pred.strip() == str(p.answer).strip():
                    self._settle(res, i, "exact", 1.0, to_judge)
                else:
                    to_verify.append(i)
                continue
            verdict = cheap_verdict(pred, p.answer)
            if verdict is None and self.math_verify and p.task in MATH_VERIFY_TASKS:
                to_verify.append(i)
                continue
            # settled here; or not, with math_verify off: that scores 0
            gold = normalize_answer(p.answer)
            res.by_value += verdict is not None and gold != "" and normalize_answer(pred) != gold
            self._settle(res, i, "exact", float(bool(verdict)), to_judge)
        return to_verify, to_judge

    def _settle(self, res, i, stage, reward, to_judge, cost=0.0) -> None:
        """A verdict; it goes on to the judge if the judge looks at verdicts of that kind."""
        res.rewards[i], res.stages[i], res.cost_s[i] = reward, stage, cost
        if self.judge is not None and (reward > 0) == (self.judge_on == "passed"):
            to_judge.append(i)

    def _verify(self, problems, preds, idx, to_judge, res) -> None:
        """Stage 4, on threads: math-verify for math and gsm8k, the sandbox's tests for code,
        reasoning-gym's own scorer for its tasks."""
        res.reached["verify"] += len(idx)
        threads = max(self.code_workers, len(self._workers))
        outs = _parallel(lambda i: self._verify_one(problems[i], preds[i]), idx, threads)
        for i, (reward, status, cost, sandbox_status) in zip(idx, outs):
            self._count(res, status, "verify")
            res.code_status.update([sandbox_status] if sandbox_status else [])
            self._settle(res, i, "verify", reward, to_judge, cost)

    def _verify_one(self, problem, pred: str) -> tuple:
        """(reward, "ok" | "timeout" | "error: ...", seconds, sandbox status | None); no raise."""
        t = time.perf_counter()
        try:
            if problem.task == "code":
                m = problem.meta
                r = run_tests(pred, list(m["test_list"]), m.get("test_setup_code") or "",
                              **self.code_limits)
                status = f"error: sandbox: {r.stderr.strip()[-200:]}" if r.status == "error" \
                    else "ok"
                return float(r.passed), status, time.perf_counter() - t, r.status
            worker = self._idle.get()
            try:
                if problem.task == RG_TASK:  # a score in [0, 1]; None where the call failed
                    value, status = worker.score_rg(problem.meta, pred)
                    return (0.0 if value is None else value), status, time.perf_counter() - t, None
                equal, status = worker.check(str(problem.answer), pred)
            finally:
                self._idle.put(worker)
            return float(bool(equal)), status, time.perf_counter() - t, None
        except Exception as e:
            return 0.0, f"error: {type(e).__name__}: {e}", time.perf_counter() - t, None

    def _judge(self, problems, texts, idx, res) -> None:
        """Stage 5: the user's judge on its pool of threads, each call with a deadline; a failed
        call, or a score that is not a number within +-JUDGE_MAX, scores 0."""
        res.reached["judge"] += len(idx)
        if not idx:
            return
        outs = self._judges.map([(problems[i].prompt, texts[i], problems[i].answer) for i in idx])
        for i, (value, status, cost) in zip(idx, outs):
            reward, status = _judge_score(value) if status == "ok" else (0.0, status)
            self._count(res, status, "judge")
            res.rewards[i], res.stages[i], res.cost_s[i] = reward, "judge", cost

    def _finite(self, res, idx) -> None:
        """Every reward a finite float: anything else (a verifier's NaN) is 0 and an error."""
        for i in idx:
            v = _real(res.rewards[i])
            if not math.isfinite(v):
                self._count(res, f"error: the reward {res.rewards[i]!r:.60} is not a finite "
                                 f"number", res.stages[i] or "reward")
            res.rewards[i] = v if math.isfinite(v) else 0.0

    @staticmethod
    def _count(res, status: str, stage: str) -> None:
        """Count a failed call (a timeout or an error) and keep its message for the log."""
        if status != "ok":
            res.timeouts += status == "timeout"
            res.errors += status != "timeout"
            res.notes += [f"{stage}: {status}"][:10 - len(res.notes)]


def load_judge(spec: str) -> Optional[Callable]:
    """'module:function' -> the callable, imported by name (the user's own file). Empty: none."""
    if not spec:
        return None
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"config key 'judge': cannot import {spec!r} ({e})") from None


if __name__ == "__main__":
    half, root = Problem("?", r"\frac{1}{2}", "math"), Problem("?", r"\frac{\sqrt{2}}{2}", "math")
    add = Problem("Write add(a, b).", "", "code", {"test_list": ["assert add(1, 2) == 3"]})
    code = "```python\ndef add(a, b){}\n```".format
    batch = [(half, r"so \boxed{\frac{1}{2}}")] * 2 + [(half, r"\boxed{.5}"),
             (half, r"so \boxed{\frac{1}{2}} and"), (root, r"\boxed{\frac{1}{\sqrt{2}}}"),
             (root, r"\boxed{0.70710678}"), (root, r"\boxed{\sqrt{3}/2}"), (root, "I give up"),
             (add, code(": return a + b")), (add, code(": return 0")), (add, code("")),
             (add, "def add(a, b): return a + b  (no code block)")]
    finish = ["eos"] * 3 + ["length"] + ["eos"] * 8  # the fourth was cut at max_new_tokens
    with Cascade(max_chars=4000) as cascade:  # three groups of four completions
        res = cascade.score_batch([p for p, _ in batch], [c for _, c in batch], 4, finish)
    for (_, text), r, s, why in zip(batch, res.rewards, res.stages, finish):
        print(f"{r:.1f}  {s:<7} {why:<7} {text!r:.60}")
    print({k: round(v, 3) for k, v in res.summary().items()})
