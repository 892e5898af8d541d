"""Rewards for GRPO: pull the final answer out of a completion and compare it with the reference.

Stage 3, first version: exact match after a small normalization. Each task has one extractor
(EXTRACTORS); `score_one` is the single place where an extracted answer is judged, so a later
verifier cascade (math-verify for symbolic equivalence, a sandbox for code tasks) can slot in
there without touching callers, which only use `score` / `score_one`.
"""
from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOX_START = re.compile(r"\\(?:boxed|fbox)")


def _clean_number(s: str) -> str:
    return s.replace(",", "").rstrip(".")


def extract_hash_answer(text: str) -> Optional[str]:
    """The number after the last "####" (GSM8K style), commas and a trailing "." stripped.

    "#### 1,234." -> "1234". Returns None when there is no "####", or nothing after it.
    If what follows is not a number, the rest of that line is returned as is.
    """
    if not isinstance(text, str) or "####" not in text:
        return None
    rest = text[text.rfind("####") + 4:].strip()
    rest = rest.splitlines()[0].strip() if rest else ""
    m = _NUMBER.search(rest)
    if m:
        return _clean_number(m.group(0))
    return rest.rstrip(".") or None


def last_number(text: str) -> Optional[str]:
    """The last number anywhere in the text (commas stripped), or None."""
    if not isinstance(text, str):
        return None
    found = _NUMBER.findall(text)
    return _clean_number(found[-1]) if found else None


def _braced(text: str, i: int) -> Optional[str]:
    """Content of the brace group opening at text[i] == "{", nested braces and \\{ \\} escapes handled."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None  # unbalanced


def extract_boxed(text: str) -> Optional[str]:
    """The content of the LAST \\boxed{...} (or \\fbox{...}) in the text, nested braces handled.

    "\\boxed{\\frac{a}{b^{2}}}" -> "\\frac{a}{b^{2}}". The brace-less form "\\boxed 5" gives "5".
    A last box that is never closed (a truncated completion) falls back to the one before it.
    Returns None when there is no usable box.
    """
    if not isinstance(text, str):
        return None
    for m in reversed(list(_BOX_START.finditer(text))):
        k = m.end()
        if text[k:k + 1] == "{":
            content = _braced(text, k)
            if content is not None:
                return content.strip()
        elif text[k:k + 1] == " ":
            tok = re.match(r" +([^\s$]+)", text[k:])
            if tok:
                return tok.group(1)
    return None


def extract_synthetic(text: str) -> Optional[str]:
    """The token after the last "#" (up to whitespace or the end): "a=7>7 b=2>9 #9" -> "9"."""
    if not isinstance(text, str) or "#" not in text:
        return None
    m = re.match(r"[ \t]*(\S+)", text[text.rfind("#") + 1:])
    return m.group(1) if m else None


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


def _extract_gsm8k(text: str) -> Optional[str]:
    ans = extract_hash_answer(text)
    return ans if ans is not None else last_number(text)


# task -> extractor. A later verifier cascade keys its checkers on the same task names.
EXTRACTORS: dict[str, Callable[[str], Optional[str]]] = {
    "synthetic": extract_synthetic,
    "gsm8k": _extract_gsm8k,
    "math": extract_boxed,
}


def extract_answer(task: str, text: str) -> Optional[str]:
    """Dispatch to the extractor for `task`; ValueError for an unknown task."""
    try:
        fn = EXTRACTORS[task]
    except KeyError:
        raise ValueError(f"no answer extractor for task {task!r}; known: {sorted(EXTRACTORS)}") from None
    return fn(text)


def score_one(problem, completion: str) -> float:
    """1.0 if the answer extracted from `completion` (by problem.task) matches problem.answer, else 0.0.

    Both sides go through normalize_answer; a completion with no extractable answer scores 0.0.
    """
    pred = extract_answer(problem.task, completion if isinstance(completion, str) else "")
    if pred is None:
        return 0.0
    gold = normalize_answer(problem.answer)
    return 1.0 if gold != "" and normalize_answer(pred) == gold else 0.0


def score(problems: Sequence, completions: Sequence[str]) -> list[float]:
    """score_one over aligned lists (one completion per problem; repeat problems for a GRPO group)."""
    if len(problems) != len(completions):
        raise ValueError(f"score: {len(problems)} problems but {len(completions)} completions")
    return [score_one(p, c) for p, c in zip(problems, completions)]
