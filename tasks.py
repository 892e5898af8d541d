"""
tasks.py: what the policy is asked, how its answer is read back, and how that answer compares with
the reference. No stage of its own: every stage reads these Problems.

    from tasks import load_problems, make_synthetic, extract_answer, cheap_verdict
    train, held_out = load_problems(cfg)          # the pool and the held-out set of a config
    make_synthetic(4, seed=0, difficulty=(2, 3))  # [Problem("c=4,a=7?a+c\\n", "1", ...), ...]
    extract_answer("gsm8k", "... #### 18 - 6 = 12")  # "12"
    cheap_verdict(".5", "1/2")                    # True: the same exact value

What is here:
    Problem            a prompt, its reference answer, its task and its meta (tests, difficulty)
    the synthetic task running sums mod 10 over named values (no downloads), its reference traces,
                       and a character tokenizer for it
    loaders            GSM8K, MATH and MBPP (code), from hub names or local .jsonl/.json/.parquet
                       files; malformed rows (not UTF-8, not JSON, not an object, a field missing)
                       are skipped with one warning that counts them and names the file and lines
    extractors         the answer a completion gives: the final value after "####" (GSM8K), the
                       last \\boxed{} (MATH), the one digit after the last "#" (synthetic)
    comparison         normalize_answer and cheap_verdict, the reward's stage 3: plain numbers by
                       exact value; a decimal approximation never matches a symbolic reference
    load_problems / encode_pool   a config's pool and held-out set, and their token ids

Simplifications:
    1. A dataset without its own test split (a local file) holds out its last n_eval rows.
    2. Prompts longer than the context (minus max_new_tokens) are dropped and counted.
    3. The synthetic task's tokenizer is one token per character; the real models bring their own.
    4. A GSM8K answer needs its "####": on that line the number after the last "=", else the last
       number ("#### 3 or 4" reads 4). There is no fallback to the last number of the text
       (last_number stays, as a helper that gives no credit).
    5. A synthetic answer is the one digit after the last "#" (spaces between allowed), and only
       whitespace may follow it: "#9>", "#3 or 4" and "#09" give no answer.
    6. Local .jsonl/.json files are read here, line by line (a .json file may also be one array of
       objects); hub names and .parquet files go through `datasets`.
    7. Plain numbers (integers, decimals such as ".5", a/b, \\frac{a}{b}) compare by exact value,
       so 0.333333 is not 1/3; an answer with a decimal and nothing symbolic never equals a
       reference with \\sqrt, \\pi, a log, a trig function, e^ or a fraction whose decimals never
       end. What neither settles is left to a verifier (the reward's math-verify).

`python -m pytest -q tests/test_prompts.py tests/test_reward.py tests/test_data.py` checks the
loaders, the extractors and the comparison.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import re
import string
import warnings
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import (TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence,
                    Union)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TASKS = ("synthetic", "gsm8k", "math", "code")
GSM8K_INSTRUCTION = ("\nSolve the problem step by step, then end with a line of the form "
                     "\"#### <answer>\".")
MATH_INSTRUCTION = "\nSolve the problem step by step, and put the final answer in \\boxed{}."
CODE_INSTRUCTION = "\nWrite the complete Python code in a ```python code block."


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
                  itself: much harder for a small model).
    """
    lo, hi = (difficulty, difficulty) if isinstance(difficulty, int) else tuple(difficulty)
    if lo < 1 or hi < lo:
        raise ValueError(f"difficulty must be an int >= 1 or a range (lo, hi) with "
                         f"1 <= lo <= hi, got {difficulty!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if order not in ("defined", "shuffled"):
        raise ValueError(f"order must be 'defined' or 'shuffled', got {order!r}")
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
    assigns, _, expr = problem.prompt.strip().partition("?")
    values = {k: int(v) for k, v in (a.split("=") for a in assigns.split(","))}
    return _trace(values, expr.split("+"))[0]


# ---------------------------------------------------------------------------------------------
# Character-level tokenizer for the synthetic task.

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # ids 3.. : newline, then printable ASCII


def build_char_tokenizer(out_dir: str) -> "PreTrainedTokenizerFast":
    """One token per character, no BOS/EOS added, exact decode round-trip; saved to out_dir and
    reloaded.

    Unknown characters map to "<unk>". Note: the literal texts "<pad>", "<eos>", "<unk>" in an
    input are read as the special tokens themselves, not as five characters.
    """
    # lazy: transformers takes seconds to import, and the reward's worker processes import this file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "\n" too
    tk.decoder = decoders.Fuse()  # concatenate; the default would join tokens with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # would otherwise rewrite " ." -> "." on decode
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def format_prompt(tokenizer, problem: Problem, chat_template: bool) -> str:
    """The text to feed the policy: the chat-templated user turn if asked for and available, else
    the raw prompt."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.prompt}], tokenize=False,
            add_generation_prompt=True)
    return problem.prompt


# ---------------------------------------------------------------------------------------------
# Loaders: rows from the hub or a local file, parsed into Problems; bad rows skipped and counted.

class _BadRow(NamedTuple):
    """A row of a local file that could not be read: where ("line 3", "item 3"), and why."""
    number: int
    reason: str  # "not UTF-8", "invalid JSON" or "not a JSON object"
    unit: str = "line"


def _json_lines(path: str) -> Iterator[Union[dict, _BadRow]]:
    """The rows of a JSON-lines file, one line at a time; blank lines are passed over."""
    with open(path, "rb") as f:
        for k, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if k == 1 else "utf-8")
            except UnicodeDecodeError:
                yield _BadRow(k, "not UTF-8")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                yield _BadRow(k, "invalid JSON")
                continue
            yield row if isinstance(row, dict) else _BadRow(k, "not a JSON object")


def _json_file(path: str) -> Iterator[Union[dict, _BadRow]]:
    """A .json file: one array of objects, one object, or else JSON lines."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        whole = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return _json_lines(path)
    if isinstance(whole, list):
        return (r if isinstance(r, dict) else _BadRow(k, "not a JSON object", "item")
                for k, r in enumerate(whole, 1))
    return iter([whole]) if isinstance(whole, dict) else _json_lines(path)


def _load_rows(source: str, split: str, config: Optional[str]) -> Iterable:
    """Rows of a local .jsonl/.json/.parquet file or of a hub dataset. ValueError naming the file
    when a local file holds no rows."""
    if os.path.isfile(source) and source.endswith((".jsonl", ".json", ".parquet")):
        if os.path.getsize(source) == 0:
            rows = iter(())
        elif source.endswith(".parquet"):
            import datasets  # lazy: only the dataset tasks need it, and it is slow to import
            rows = iter(datasets.load_dataset("parquet", data_files=source, split="train"))
        else:
            rows = (_json_file if source.endswith(".json") else _json_lines)(source)
        first = next(rows, None)
        if first is None:
            raise ValueError(f"data file {source} is empty: no rows to read")
        return itertools.chain([first], rows)
    import datasets

    if config is None:
        return datasets.load_dataset(source, split=split)
    return datasets.load_dataset(source, config, split=split)  # e.g. "openai/gsm8k", "main"


def _text_field(row: dict, key: str) -> tuple[Optional[str], Optional[str]]:
    """(value, None) for a usable string field, else (None, reason)."""
    v = row.get(key)
    if v is None:
        return None, f"missing '{key}'"
    if not isinstance(v, str):
        return None, f"non-string '{key}'"
    if not v.strip():
        return None, f"empty '{key}'"
    return v, None


def _places(bad: list) -> str:
    """" (line 4)", " (lines 4, 9, ...)": where the unreadable rows of one reason are."""
    if not bad:
        return ""
    unit = bad[0].unit + ("s" if len(bad) > 1 else "")
    shown = ", ".join(str(b.number) for b in bad[:5]) + (", ..." if len(bad) > 5 else "")
    return f" ({unit} {shown})"


def _collect(rows: Iterable, parse, name: str, limit: Optional[int]) -> list[Problem]:
    """Parse rows with `parse(row, i) -> (Problem | None, reason | None)`; one warning about the
    skipped rows (a ValueError if no row is good)."""
    good, skipped, unreadable, total = [], Counter(), {}, 0
    for i, row in enumerate(rows):
        if limit is not None and len(good) >= limit:
            break
        total += 1
        if isinstance(row, _BadRow):
            prob, reason = None, row.reason
            unreadable.setdefault(reason, []).append(row)
        elif not isinstance(row, dict):
            prob, reason = None, "not a JSON object"
        else:
            prob, reason = parse(row, i)
        if prob is None:
            skipped[reason] += 1
        else:
            good.append(prob)
    if skipped:
        detail = ", ".join(f"{r}: {c}{_places(unreadable.get(r))}" for r, c in skipped.items())
        msg = f"{name}: skipped {sum(skipped.values())} of {total} malformed rows: {detail}"
        if not good:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
    return good


def problems_from_gsm8k_rows(rows: Iterable[dict], name: str = "gsm8k",
                             limit: Optional[int] = None) -> list[Problem]:
    """GSM8K-schema rows ({"question", "answer": "... #### 72"}) -> Problems; malformed rows
    skipped with a warning."""
    def parse(row, i):
        q, why = _text_field(row, "question")
        if why:
            return None, why
        a, why = _text_field(row, "answer")
        if why:
            return None, why
        if "####" not in a:
            return None, "no '####' in answer"
        gold = extract_hash_answer(a)
        if gold is None:
            return None, "nothing after '####' in answer"
        meta = {"solution": a, "index": i}
        return Problem(q.strip() + GSM8K_INSTRUCTION, gold, "gsm8k", meta), None

    return _collect(rows, parse, name, limit)


def problems_from_math_rows(rows: Iterable[dict], name: str = "math",
                            limit: Optional[int] = None) -> list[Problem]:
    """MATH-schema rows -> Problems. The answer is the row's `answer` field when present
    (MATH-500), else the last \\boxed{} of `solution`. level/type/subject are kept in meta."""
    def parse(row, i):
        p, why = _text_field(row, "problem")
        if why:
            return None, why
        meta = {k: row[k] for k in ("level", "type", "subject") if row.get(k) is not None}
        meta["index"] = i
        if row.get("answer") is not None:
            gold, why = _text_field(row, "answer")
            if why:
                return None, why
        else:
            sol, why = _text_field(row, "solution")
            if why:
                return None, why
            gold = extract_boxed(sol)
            if not gold:
                return None, "no \\boxed{} in solution"
            meta["solution"] = sol
        return Problem(p.strip() + MATH_INSTRUCTION, gold.strip(), "math", meta), None

    return _collect(rows, parse, name, limit)


def load_gsm8k(source: str = "openai/gsm8k", split: str = "train",
               limit: Optional[int] = None) -> list[Problem]:
    """GSM8K from the hub (config "main") or a local .jsonl/.json/.parquet file in that schema."""
    rows = _load_rows(source, split, "main")
    return problems_from_gsm8k_rows(rows, f"gsm8k ({source})", limit)


def load_math(source: str = "DigitalLearningGmbH/MATH-lighteval", split: str = "train",
              limit: Optional[int] = None) -> list[Problem]:
    """MATH (or MATH-500 style, with an `answer` column) from the hub or a local file."""
    return problems_from_math_rows(_load_rows(source, split, None), f"math ({source})", limit)


def problems_from_mbpp_rows(rows: Iterable[dict], name: str = "mbpp",
                            limit: Optional[int] = None) -> list[Problem]:
    """MBPP-schema rows -> code Problems. The prompt shows the first test (after the setup code,
    if any) as an example; the answer is the reference code; meta keeps task_id, test_list,
    test_setup_code and challenge_test_list, which the reward's sandbox stage runs."""
    def parse(row, i):
        text, why = _text_field(row, "text")
        if why:
            return None, why
        code, why = _text_field(row, "code")
        if why:
            return None, why
        tests, setup = row.get("test_list"), row.get("test_setup_code") or ""
        if not (isinstance(tests, (list, tuple)) and tests
                and all(isinstance(t, str) and t.strip() for t in tests)):
            return None, "no usable 'test_list'"
        if not isinstance(setup, str):
            return None, "non-string 'test_setup_code'"
        example = f"{setup.strip()}\n{tests[0]}" if setup.strip() else tests[0]  # it may use them
        prompt = f"{text.strip()}\nYour code should pass this test:\n{example}{CODE_INSTRUCTION}"
        meta = {"task_id": row.get("task_id"), "test_list": list(tests), "test_setup_code": setup,
                "challenge_test_list": list(row.get("challenge_test_list") or []), "index": i}
        return Problem(prompt, code, "code", meta), None

    return _collect(rows, parse, name, limit)


def load_mbpp(source: str = "google-research-datasets/mbpp", split: str = "train",
              limit: Optional[int] = None) -> list[Problem]:
    """MBPP ("full" config: text, code, test_list, ...) from the hub or a local file in that
    schema."""
    return problems_from_mbpp_rows(_load_rows(source, split, None), f"mbpp ({source})", limit)


# ---------------------------------------------------------------------------------------------
# A config's problems and their token ids.

def load_problems(cfg) -> tuple[list[Problem], list[Problem]]:
    """-> (training pool, held-out problems) for config keys task, data, n_train, n_eval,
    difficulty, order."""
    if cfg.task == "synthetic":
        return (make_synthetic(cfg.n_train or 20_000, cfg.seed, cfg.difficulty, cfg.order),
                make_synthetic(cfg.n_eval, cfg.seed + 10_000, cfg.difficulty, cfg.order))
    loader = {"gsm8k": load_gsm8k, "math": load_math, "code": load_mbpp}.get(cfg.task)
    if loader is None:
        raise ValueError(f"config key 'task' must be synthetic, gsm8k, math or code, "
                         f"got {cfg.task!r}")
    src = {"source": cfg.data} if cfg.data else {}
    if cfg.data and os.path.exists(cfg.data):  # one local file: hold out its last n_eval rows
        rows = loader(**src)
        return rows[:-cfg.n_eval] if len(rows) > cfg.n_eval else rows, rows[-cfg.n_eval:]
    return (loader(split="train", limit=cfg.n_train or None, **src),
            loader(split="test", limit=cfg.n_eval, **src))


def encode_pool(tok, problems: Sequence[Problem], cfg, ctx: int,
                log=print) -> tuple[list[Problem], list[list[int]]]:
    """Token ids of every prompt; prompts too long for the context are dropped and counted (not
    fatal)."""
    keep, ids = [], []
    for p in problems:
        t = tok.encode(format_prompt(tok, p, cfg.chat_template), add_special_tokens=False)
        if 0 < len(t) <= ctx - cfg.max_new_tokens:
            keep.append(p)
            ids.append(t)
    if len(keep) < len(problems):
        log(f"dropped {len(problems) - len(keep)} of {len(problems)} prompts longer than context "
            f"{ctx} - max_new_tokens {cfg.max_new_tokens}")
    if not keep:
        raise ValueError("no prompt fits in the context; lower max_new_tokens or use a "
                         "longer-context model")
    return keep, ids


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
