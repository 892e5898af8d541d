"""
synthetic.py: the synthetic task, home-made and offline, and the Problem every task returns. It is
tasks.py's first half: tasks.py re-exports all of it, so `from tasks import make_synthetic` works.

    from synthetic import make_synthetic, synthetic_trace
    make_synthetic(4, seed=0, difficulty=(2, 3))  # [Problem("c=4,a=7?a+c\\n", "1", ...), ...]
    synthetic_trace(problem)                      # the reference completion SFT trains on

Running sums mod 10 over named values, in four orders (make_synthetic): "defined" and "shuffled"
(the lookup is by position or by name), "marked" (a constant layout: the bench workload
configs/marked.py) and "lagged" (a stream the model extends line by line: 1,000+ generated tokens,
the long-CoT regime of configs/lagged.py). Each comes with its exact trace.

Simplifications:
    1. One digit per value and sums mod 10: the answer is one digit, guessed 1 time in 10; the
       default task (reasoning-gym's chain_sum, tasks.py) has answers that cannot be guessed.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from config import MARKED_VARS

ORDERS = ("defined", "shuffled", "marked", "lagged")  # the synthetic task's variants


@dataclass
class Problem:
    prompt: str
    answer: str
    task: str  # one of TASKS
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Synthetic task: "c=4,a=7,b=2?a+b+a\n" -> trace "a=7>7 b=2>9 a=7>6 #6", answer "6".
# Every step must look a value up in the assignment list at the start, and the answer is the
# running sum mod 10, so the final token depends on the whole chain. Trace length is 6*d+2 chars.

def _trace(values: dict, terms: Sequence[str]) -> tuple[str, str]:
    steps, total = [], 0
    for t in terms:
        total = (total + values[t]) % 10
        steps.append(f"{t}={values[t]}>{total}")
    return " ".join(steps) + f" #{total}", str(total)


def _names(rng: random.Random, k: int) -> list[str]:
    """k distinct variable names: single letters while they last, then two-letter names."""
    letters = string.ascii_lowercase
    pool = list(letters) if k <= 26 else [x + y for x in letters for y in letters]
    if k > len(pool):
        raise ValueError(f"the synthetic task supports at most {len(pool)} variables, "
                         f"asked for {k}")
    return rng.sample(pool, k)


def make_synthetic(n: int, seed: int, difficulty: Union[int, tuple[int, int]] = (1, 8),
                   order: str = "defined") -> list[Problem]:
    """n problems, deterministic from `seed`; each draws d uniformly from the inclusive
    `difficulty` range.

    d is the number of terms to add. `order` sets how hard each lookup is:
      "defined":  d variables, summed in the order they are defined (the value to look up sits at
                  a position that moves steadily through the prompt: a small model learns it in a
                  few hundred SFT steps);
      "shuffled": d of d + 2 variables, summed in a random order (each lookup must match the name
                  itself: much harder for a small model);
      "marked":   always MARKED_VARS variables; the chain is the first d of them, its last one
                  ends with "." instead of "," ("a=3,b=5,c=1.d=4,...?"), and the trace restates
                  each value and its separator ("3>3,5>8,1>9.#9"): a step is the same at any d and
                  the chain ends on content, not on a count (see _make_marked).
      "lagged":   the long-generation variant: the prompt is LAG_LINES lines of LAG_WIDTH digit
                  pairs, and the completion carries the stream on, line by line; each pair restates
                  the running sum LAG_LINES lines above and adds it to its own; d is the number of
                  lines it writes, 65 tokens each (see lagged_trace).
    """
    lo, hi = (difficulty, difficulty) if isinstance(difficulty, int) else tuple(difficulty)
    if lo < 1 or hi < lo:
        raise ValueError(f"difficulty must be an int >= 1 or a range (lo, hi) with "
                         f"1 <= lo <= hi, got {difficulty!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if order == "marked":
        return _make_marked(n, seed, lo, hi)
    if order == "lagged":
        return _make_lagged(n, seed, lo, hi)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.randint(lo, hi)
        names = _names(rng, d if order == "defined" else d + 2)
        values = {name: rng.randint(0, 9) for name in names}
        terms = names if order == "defined" else rng.sample(names, d)
        prompt = ",".join(f"{k}={v}" for k, v in values.items()) + "?" + "+".join(terms) + "\n"
        trace, answer = _trace(values, terms)
        out.append(Problem(prompt, answer, "synthetic", {"difficulty": d, "trace": trace}))
    return out


def synthetic_trace(problem: Problem) -> str:
    """The reference completion (what SFT trains on), recomputed from the prompt itself."""
    if is_lagged(problem.prompt):
        return lagged_trace(problem.prompt)[0]
    assigns, _, expr = problem.prompt.strip().partition("?")
    if not expr:  # order="marked": no expression, the chain ends at the "."
        return _marked_trace(assigns)[0]
    values = {k: int(v) for k, v in (a.split("=") for a in assigns.split(","))}
    return _trace(values, expr.split("+"))[0]


# order="marked": a length-generalization variant. The prompt always holds MARKED_VARS (config.py)
# items of 4 characters ("k=v," or, for the chain's last one, "k=v."), the chain being the first d,
# and each trace step is 4 characters too ("v>s," : the value, the running sum, the item's
# separator), so step k reads item k at the same distance for every k and d. Only the number of
# items after the "." (MARKED_VARS - d) changes with d: a warm start trained on short chains has
# only seen many. In the current format a model looks values up by their distance, which a longer
# prompt moves: SFT on chains of 2 to 6 falls to chance at 7; here it can carry on past 6.


def _marked_trace(assigns: str) -> tuple[str, str]:
    steps, total = [], 0
    for i in range(0, len(assigns), 4):
        value, sep = int(assigns[i + 2]), assigns[i + 3]
        total = (total + value) % 10
        steps.append(f"{value}>{total}{sep}")
        if sep == ".":
            break
    return "".join(steps) + f"#{total}", str(total)


def _make_marked(n: int, seed: int, lo: int, hi: int) -> list[Problem]:
    if hi > MARKED_VARS:
        raise ValueError(f"order 'marked' supports difficulties up to {MARKED_VARS}, "
                         f"asked for {hi}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.randint(lo, hi)
        names = _names(rng, MARKED_VARS)
        assigns = "".join(f"{k}={rng.randint(0, 9)}{'.' if i == d - 1 else ','}"
                          for i, k in enumerate(names))
        trace, answer = _marked_trace(assigns)
        out.append(Problem(assigns + "?\n", answer, "synthetic", {"difficulty": d, "trace": trace}))
    return out


# order="lagged": long generations (1,000 tokens and more) for a small model. The prompt is
# LAG_LINES lines of LAG_WIDTH pairs of digits; the completion carries the stream of pairs on, line
# by line. A pair is "vs": v restates the s of the pair LAG_LINES lines above, and s is the running
# sum, (the previous pair's s + v) mod 10. So every v copies one token at a fixed distance back
# (LAG_LINES lines, 2 * LAG_WIDTH + 1 tokens each, minus one) and every s reads the two tokens
# before it: a sharp, far plus local attention pattern, the same at every position, so a warm start
# trained on a few lines carries on for dozens. (Restating v is what makes it learnable: the copy
# alone lowers the loss, while a sum of two unseen digits is as uniform as either.) The chain ends
# on content: where a line's first v would be 0, the trace writes "#" and the last s instead, and
# that digit is the answer. d (the lines written) is drawn by rejection, uniform over its range.

LAG_WIDTH, LAG_LINES = 32, 4  # a line is 65 tokens with its "\n"; the lag is 256 tokens


def is_lagged(prompt: str) -> bool:
    return (len(prompt) == LAG_LINES * (2 * LAG_WIDTH + 1)
            and set(prompt) <= set("0123456789\n"))


def lagged_trace(prompt: str, slip: float = 0.0, rng: Optional[random.Random] = None,
                 max_lines: int = 0) -> tuple[str, str, int]:
    """-> (trace, answer, lines written). `slip` (the warm start's teacher): where the pair before
    is "99" and v is 9, with that probability s is 9 instead of 8, and the stream carries on from
    it (one pair in 1,000: a rare slip that sampling sometimes avoids). A slip changes where the
    stream ends; `max_lines` > 0 cuts a trace that runs past that many lines, which is then a
    prefix with no "#" (SFT trains on it without an end)."""
    digits = [int(c) for c in prompt if c != "\n"]
    return _carry_on(digits[1::2], digits[-2], slip, rng, max_lines)


def _carry_on(s, pv, slip=0.0, rng=None, max_lines=0):
    """lagged_trace from the prompt's running sums `s` (a list it extends) and its last v."""
    lag, out, lines = LAG_LINES * LAG_WIDTH, [], 0
    while not max_lines or lines < max_lines:
        line = []
        for j in range(LAG_WIDTH):
            v = s[-lag]
            if j == 0 and v == 0:
                return "".join(out) + f"#{s[-1]}", str(s[-1]), lines
            t = (s[-1] + v) % 10
            if slip and pv == s[-1] == v == 9 and rng.random() < slip:
                t = 9
            s.append(t)
            pv = v
            line.append(f"{v}{t}")
        out.append("".join(line) + "\n")
        lines += 1
    return "".join(out), "", lines


def _make_lagged(n: int, seed: int, lo: int, hi: int) -> list[Problem]:
    rng, out = random.Random(seed), []
    lag = LAG_LINES * LAG_WIDTH
    while len(out) < n:
        s = [rng.randint(0, 9) for _ in range(lag)]
        # without a slip the prompt's v do not matter; a chain past hi lines is cut there
        trace, answer, d = _carry_on(list(s), 0, max_lines=hi + 1)
        # P(d) falls as 0.9^d: keep a d with chance 0.9^(hi - d), and every d in range is as likely
        if lo <= d <= hi and rng.random() < 0.9 ** (hi - d):
            pairs = [f"{rng.randint(0, 9)}{x}" for x in s]  # the prompt's v are noise
            prompt = "".join("".join(pairs[i:i + LAG_WIDTH]) + "\n"
                             for i in range(0, lag, LAG_WIDTH))
            out.append(Problem(prompt, answer, "synthetic", {"difficulty": d, "trace": trace}))
    return out
