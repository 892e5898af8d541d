"""
answers.py: how a completion's answer is read back, and whether it equals the reference: the
extractors and the comparison that the reward's cheap stages use (reward.py), and the process
that runs its expensive verifiers.

    from answers import extract_answer, cheap_verdict
    extract_answer("gsm8k", "... #### 18 - 6 = 12")  # "12"
    cheap_verdict(".5", "1/2")                        # True: the same exact value
    cheap_verdict("1.41421356", "\\sqrt{2}")          # False: a decimal is not a symbolic answer

What is here:
    extractors         the answer a completion gives: the final value after "####" (GSM8K), the
                       last \\boxed{} (MATH, one linear scan), the one digit after the last "#"
                       (synthetic), everything after the last "####" (reasoning-gym)
    comparison         normalize_answer and cheap_verdict, the reward's stage 3: plain numbers by
                       exact value; None where only a verifier can tell
    VerifyWorker       the verifiers of the reward's stage 4 in a process of their own, killed at
                       a deadline: math-verify, and reasoning-gym's score_answer (`python
                       answers.py --verify-worker MEM_MB ALARM_S [--rg]` is that process)

Simplifications:
    1. A GSM8K answer needs its "####": on that line the number after the last "=", else the last
       number ("#### 3 or 4" reads 4). There is no fallback to the last number of the text
       (last_number stays, as a helper that gives no credit).
    2. A synthetic answer is the one digit after the last "#" (spaces between allowed), and only
       whitespace may follow it: "#9>", "#3 or 4" and "#09" give no answer.
    3. Plain numbers (integers, decimals such as ".5", a/b, \\frac{a}{b}) compare by exact value,
       so 0.333333 is not 1/3; an answer with a decimal and nothing symbolic never equals a
       reference with \\sqrt, \\pi, a log, a trig function, e^ or a fraction whose decimals never
       end. What neither settles is left to a verifier (the reward's math-verify).

`python -m pytest -q tests/test_reward.py` checks the extractors and the comparison.
"""
from __future__ import annotations

import base64
import json
import math
import os
import pickle
import re
import select
import subprocess
import sys
import time
from fractions import Fraction
from typing import Callable, Optional


# ---------------------------------------------------------------------------------------------
# Answer extractors: what a completion answers (the reward's cascade compares it with the gold).

# A number in running text: a sign (not the minus of "18-6"), then a simple fraction "1/2",
# thousands groups "1,234,567" (never "12,13"), digits, a decimal "2.5" or ".5".
_NUMBER = re.compile(r"(?:(?<![\w.)\]}])-)?(?:\d+/\d+(?![\d.,]\d)"
                     r"|(?:\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?:\.\d+)?|\.\d+)")
_BOX_SCAN = re.compile(r"\\(?:boxed|fbox)|\\[\s\S]|[{}]")
_BARE_BOX = re.compile(r" +([^\s$]+)")
_SYNTHETIC_ANSWER = re.compile(r"[ \t]*(\d)\s*")


def extract_hash_answer(text: str) -> Optional[str]:
    """The final value after the last "####" (GSM8K style): on that line, the number after the
    last "=", else the line's last number; thousands commas dropped.

    "#### 1,234." -> "1234", "#### 18 - 6 = 12" -> "12", "#### .5" -> ".5", "#### 1/2" -> "1/2",
    "#### 12,13" -> "13" (not a thousands grouping). None when there is no "####" or nothing
    after it. A line with no number is returned as is ("#### seven" -> "seven").
    """
    if not isinstance(text, str) or "####" not in text:
        return None
    rest = text[text.rfind("####") + 4:].strip()
    line = rest.splitlines()[0].strip() if rest else ""
    tail = line.rpartition("=")[2].strip()
    found = _NUMBER.findall(tail) or _NUMBER.findall(line)
    if found:
        return found[-1].replace(",", "")
    return (tail or line).rstrip(".") or None


def last_number(text: str) -> Optional[str]:
    """The last number anywhere in the text (commas stripped), or None. A helper: no reward
    reads it (a number anywhere is no answer)."""
    if not isinstance(text, str):
        return None
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_boxed(text: str) -> Optional[str]:
    """The content of the LAST \\boxed{...} (or \\fbox{...}) in the text, nested braces handled.

    "\\boxed{\\frac{a}{b^{2}}}" -> "\\frac{a}{b^{2}}". The brace-less form "\\boxed 5" gives "5".
    A last box that is never closed (a truncated completion) falls back to the one before it.
    Escapes (\\{ \\} \\\\) never open or close a group. Returns None when there is no usable box.
    One left-to-right scan with a stack of the open braces: linear in the text.
    """
    if not isinstance(text, str):
        return None
    best, stack = None, []  # best: (start, content start, content end) of the last box begun
    box_start, open_at = -1, -1  # the last \boxed seen, and where its "{" would be
    for m in _BOX_SCAN.finditer(text):
        tok, at = m.group(0), m.start()
        if tok == "{":  # a box's own "{", or a plain group (None)
            stack.append((box_start, at + 1) if at == open_at else None)
        elif tok == "}":
            box = stack.pop() if stack else None
            if box is not None and (best is None or box[0] > best[0]):
                best = (box[0], box[1], at)
        elif len(tok) > 2:  # \boxed or \fbox (an escape is two characters)
            box_start, open_at = at, m.end()
            bare = None if text.startswith("{", m.end()) else _BARE_BOX.match(text, m.end())
            if bare and (best is None or at > best[0]):
                best = (at, bare.start(1), bare.end(1))
    return None if best is None else text[best[1]:best[2]].strip()


def extract_final(text: str) -> Optional[str]:
    """Everything after the last "####", stripped (reasoning-gym: an answer may be an expression,
    a list or several lines, and the library's scorer reads it whole): "so\\n#### 3 + 4" ->
    "3 + 4". None when there is no "####"."""
    if not isinstance(text, str) or "####" not in text:
        return None
    return text[text.rfind("####") + 4:].strip()


def extract_synthetic(text: str) -> Optional[str]:
    """The one digit after the last "#", when only whitespace follows it: "a=7>7 b=2>9 #9" -> "9".
    "#9>", "#3 or 4", "#12" -> None."""
    if not isinstance(text, str) or "#" not in text:
        return None
    m = _SYNTHETIC_ANSWER.fullmatch(text, text.rfind("#") + 1)
    return m.group(1) if m else None


# task -> extractor. Code has none: its cheap check and its verifier live in the cascade.
EXTRACTORS: dict[str, Callable[[str], Optional[str]]] = {
    "synthetic": extract_synthetic,
    "gsm8k": extract_hash_answer,
    "math": extract_boxed,
    "reasoning_gym": extract_final,
}


def extract_answer(task: str, text: str) -> Optional[str]:
    """Dispatch to the extractor for `task`; ValueError for an unknown task."""
    try:
        fn = EXTRACTORS[task]
    except KeyError:
        raise ValueError(f"no answer extractor for task {task!r}; "
                         f"known: {sorted(EXTRACTORS)}") from None
    return fn(text)


# ---------------------------------------------------------------------------------------------
# Comparison: an extracted answer against the reference (the reward's stage 3).

_THOUSANDS = re.compile(r"(?<![\d,.])\d{1,3}(?:,\d{3})+(?!\d|,\d)")
_INTEGER = re.compile(r"(-?)0*(\d+)")
_DEC = r"(?:\d+(?:\.\d+)?|\.\d+)"
_PLAIN = re.compile(rf"(-?)({_DEC})")
_SLASH = re.compile(rf"(-?)({_DEC})/({_DEC})")
_FRAC = re.compile(rf"(-?)\\[dt]?frac(?:\{{(-?{_DEC})\}}\{{(-?{_DEC})\}}|(\d)(\d))")
_DECIMAL = re.compile(r"\d*\.\d+")
_SYMBOLIC = re.compile(r"\\(?:sqrt|pi|log|ln|exp|sin|cos|tan|cot|sec|csc|arc|infty)|π|√"
                       r"|(?<![a-zA-Z\\])e\^|\^\{?-?(?:\d+/|\\[dt]?frac)")
_FRACTIONS = re.compile(r"\\[dt]?frac\{(\d{1,30})\}\{(\d{1,30})\}|\\[dt]?frac(\d)(\d)"
                        r"|(?<![\d.])(\d{1,30})/(\d{1,30})(?![\d.])")


def _drop_thousands_commas(s: str) -> str:
    """Thousands commas dropped outside brackets only: "1,234" -> "1234", "(1,234)" stays."""
    parts, depth, start = [], 0, 0
    _ungroup = lambda t: _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), t)  # noqa: E731
    for j, c in enumerate(s):
        if c in "([{":
            if depth == 0:
                parts.append(_ungroup(s[start:j]))
                start = j
            depth += 1
        elif c in ")]}" and depth:
            depth -= 1
            if depth == 0:
                parts.append(s[start:j + 1])
                start = j + 1
    parts.append(_ungroup(s[start:]) if depth == 0 else s[start:])
    return "".join(parts)


def normalize_answer(s: Optional[str]) -> str:
    """A small canonical form so that trivially different spellings compare equal.

    In order: drop "\\left"/"\\right", "$" and all whitespace; remove the commas of thousands
    groups outside brackets ("1,234,567" -> "1234567"; "12,13", "(1,234)" and "(1,2)" keep
    theirs: a tuple is not a number); strip a trailing "."; drop a zero fractional part ("5.0",
    "5.00" -> "5"). Values (fractions vs decimals) are cheap_verdict's, symbolic equivalence the
    verifier's. None normalizes to "".
    """
    if s is None:
        return ""
    s = str(s).replace("\\left", "").replace("\\right", "").replace("$", "")
    s = _drop_thousands_commas(re.sub(r"\s+", "", s))
    s = s.rstrip(".")
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)
    return s


def _integer(s: str) -> Optional[str]:
    """A canonical spelling of a plain integer ("-007" -> "-7", "-0" -> "0"), or None. Strings,
    not int(): Python refuses to convert integers of more than 4,300 digits."""
    m = _INTEGER.fullmatch(s)
    if m is None:
        return None
    return m.group(2) if m.group(2) == "0" else m.group(1) + m.group(2)


def _rational(s: str) -> Optional[Fraction]:
    """The exact value of a plain number, normalized: "-3", "2.50", ".5", "1/2", "\\frac{1}{2}",
    "\\dfrac{-3}{4}", "\\frac12"; None for anything else (a mixed number, an expression)."""
    try:
        if len(s) > 400:
            return None
        if (m := _PLAIN.fullmatch(s)) is not None:
            value = Fraction(m.group(2))
        elif (m := _SLASH.fullmatch(s)) is not None:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
        elif (m := _FRAC.fullmatch(s)) is not None:
            num, den = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
            value = Fraction(num) / Fraction(den)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return -value if m.group(1) else value


def _symbolic(s: str) -> bool:
    """Whether a normalized reference is an exact value a decimal can only approximate: it has a
    root, pi, a log, a trig function, e^, a fractional power, or a fraction whose decimals never
    end ("1\\frac{1}{3}")."""
    if _SYMBOLIC.search(s):
        return True
    for m in _FRACTIONS.finditer(s):
        a, b = [int(g) for g in m.groups() if g is not None]
        d = Fraction(a, b).denominator if b else 1
        while d % 2 == 0 or d % 5 == 0:
            d //= 2 if d % 2 == 0 else 5
        if d != 1:  # a/b has decimals that never end
            return True
    return False


def cheap_verdict(pred: Optional[str], gold: Optional[str]) -> Optional[bool]:
    """The reward's stage 3: True or False when a cheap comparison settles it, None when only a
    verifier can.

    Equal after normalize_answer: True. Both plain integers ("072" passes for "72"), or both plain
    numbers (".5", "1/2", "\\frac{1}{2}", "0.50" are equal; "0.333333" is not "1/3"): their exact
    values decide. A decimal approximation (a decimal and nothing symbolic: "1.41421356",
    "\\approx 1.414") against a symbolic value (\\sqrt{2}), either way round: False. No answer or
    no reference answer: False. Anything else (expressions, leftovers such as "9>") is None: a
    verifier reads those, and a cheap rule could disagree.
    """
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    ip, ig = _integer(p), _integer(g)
    if ip is not None and ig is not None:
        return ip == ig
    rp, rg = _rational(p), _rational(g)
    if rp is not None and rg is not None:
        return rp == rg
    for a, b, rb in ((p, g, rg), (g, p, rp)):  # an approximation ("1.414", "\\approx1.414...")
        if rb is None and _DECIMAL.search(a) and _symbolic(b) and not _symbolic(a):
            return False
    return None


# ---------------------------------------------------------------------------------------------
# The verifiers that a cheap comparison cannot stand in for, in a worker process: math-verify
# (it hangs for good on 10^{10^{10^{10}}}) and reasoning-gym's scorers (countdown's evaluates the
# answer as Python). The reward's stage 4 calls them with a deadline and kills what overruns it.

class VerifyWorker:
    """One verifier process (`python answers.py --verify-worker ...`), spoken to in JSON lines:
    math-verify, and reasoning-gym's scorers. The reward's stage 4 (reward.py) holds a few.

    A call past its deadline kills the process and the next call starts a fresh one (about a
    second: importing sympy; 1.5 s more with reasoning-gym, imported once a scorer is asked for).
    A worker that dies (e.g. on its memory cap) is restarted the same way.
    """

    def __init__(self, mem_mb: int, timeout_s: float):
        self.mem_mb, self.timeout_s, self.proc = int(mem_mb), float(timeout_s), None
        self.rg = False  # whether the process imports reasoning-gym when it starts

    def _start(self) -> None:
        alarm_s = math.ceil(self.timeout_s) + 1  # the worker's own alarm fires after our deadline
        here = os.path.abspath(__file__)
        self.proc = subprocess.Popen(
            [sys.executable, here, "--verify-worker", str(self.mem_mb), str(alarm_s)]
            + (["--rg"] if self.rg else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=os.path.dirname(here))
        ready = self._read(time.monotonic() + 120)  # the first import can be slow on a busy machine
        if ready != {"ready": True}:
            self.kill()
            raise RuntimeError(f"the verify worker did not start: {ready}")

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
        reply, status = self._ask({"gold": gold, "pred": pred}, "math-verify")
        return (bool(reply.get("equal")), status) if status == "ok" else (None, status)

    def score_rg(self, meta: dict, pred: str) -> tuple:
        """reasoning-gym's score_answer(pred, item) for a problem's meta (tasks.make_reasoning_gym)
        -> (score, "ok"), (None, "timeout") or (None, "error: ..."). The item travels pickled:
        its metadata keeps its tuples, which JSON would make lists."""
        if not self.rg:  # a worker started without reasoning-gym: the next start imports it
            self.rg = True
            self.kill()
        item = (meta["rg_name"], meta.get("rg_kwargs") or {}, pred, meta["entry"])
        req = {"rg": base64.b64encode(pickle.dumps(item)).decode()}
        reply, status = self._ask(req, f"reasoning-gym {meta['rg_name']}")
        return (reply.get("score"), status) if status == "ok" else (None, status)

    def _ask(self, request: dict, what: str) -> tuple:
        """(reply, "ok"), or (None, "timeout" | "error: ..."); a hung worker is killed."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read(time.monotonic() + self.timeout_s)
        except (OSError, RuntimeError, ValueError) as e:
            self.kill()
            return None, f"error: {what} worker: {e}"
        if reply is None:
            hung = self.proc.poll() is None
            self.kill()
            return (None, "timeout") if hung else (None, f"error: the {what} worker died")
        if "error" in reply:
            return None, f"error: {what}: {reply['error']}"
        return reply, "ok"

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()


def _verify_worker(mem_mb: int, alarm_s: int, rg: bool = False) -> None:
    """The worker's loop: one request per line in ({"gold", "pred"} for math-verify, {"rg": the
    pickled (name, settings, answer, item)} for a reasoning-gym scorer), one reply per line out."""
    import functools
    import resource
    import signal

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library that prints writes to stderr, never into the replies

    def send(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    # 10^{10^{10}} ends in MemoryError
    resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
    try:
        import logging

        from math_verify import parse, verify
        logging.disable(logging.WARNING)  # math-verify logs every parse failure
        if rg:
            import reasoning_gym
    except Exception as e:
        return send({"ready": False, "error": f"{type(e).__name__}: {e}"})
    # countdown's scorer evaluates the answer as Python (sympy's parse_expr): it may write no file
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # replies go to a pipe, not a file
    parse_gold = functools.lru_cache(maxsize=4096)(
        lambda s: parse(f"${s}$", parsing_timeout=alarm_s))
    scorers = {}  # (name, settings) -> score_answer of a dataset made once

    def rg_score(name, kwargs, answer, item):
        key = (name, repr(sorted(kwargs.items())))
        if key not in scorers:  # size 1: some generators build their items when made
            scorers[key] = reasoning_gym.create_dataset(name, size=1, seed=0, **kwargs).score_answer
        return float(scorers[key](answer, item))

    send({"ready": True})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if "rg" in req:  # pickled by our own trainer, so safe to load
                signal.alarm(alarm_s)  # an orphan stuck in a scorer ends (we kill it sooner)
                score = rg_score(*pickle.loads(base64.b64decode(req["rg"])))
                signal.alarm(0)
                send({"score": score})
                continue
            gold, pred = parse_gold(req["gold"]), parse(f"${req['pred']}$", parsing_timeout=alarm_s)
            send({"equal": bool(gold and pred and verify(gold, pred, timeout_seconds=alarm_s))})
        except BaseException as e:  # MemoryError included: report it and take the next request
            send({"error": f"{type(e).__name__}: {e}"[:300]})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verify-worker"]:
        sys.exit(_verify_worker(int(sys.argv[2]), int(sys.argv[3]), "--rg" in sys.argv[4:]))
