"""
tasks.py: what the policy is asked. No stage of its own: every stage reads these Problems.

    from tasks import load_problems, make_synthetic
    train, held_out = load_problems(cfg)          # the pool and the held-out set of a config
    make_synthetic(4, seed=0, difficulty=(2, 3))  # [Problem("c=4,a=7?a+c\\n", "1", ...), ...]

What is here:
    Problem            a prompt, its reference answer, its task and its meta (tests, difficulty)
    the synthetic task running sums mod 10 over named values (no downloads), or over a stream the
                       model extends line by line (order "lagged": 1,000+ generated tokens), its
                       reference traces, and a character tokenizer for it
    loaders            GSM8K, MATH and MBPP (code), from hub names or local .jsonl/.json/.parquet
                       files; malformed rows (not UTF-8, not JSON, not an object, a field missing)
                       are skipped with one warning that counts them and names the file and lines
    reasoning-gym      its procedural generators (chain_sum, countdown, gsm_symbolic, ... over
                       100), offline; each item keeps its entry for the library's score_answer
    load_problems / encode_pool   a config's pool and held-out set (synthetic, reasoning-gym:
                       disjoint from the pool and the warm start's SFT data by prompt), and their
                       token ids
How an answer is read back and compared with the reference is answers.py's.

reasoning-gym tasks: `task="reasoning_gym:<name>"`, the generator's settings in `rg_kwargs`
(config.py checks both when the config is parsed), e.g.

    python train.py configs/countdown_qwen3.py
    make_reasoning_gym("chain_sum", 4, seed=0, kwargs={"min_terms": 2, "max_terms": 3})

A problem's prompt is the item's question and RG_INSTRUCTION ("####" then the answer: answers.py
reads what follows the last "####"); its answer is the item's, and meta["entry"] the whole item,
which the reward's last stage hands to the library's score_answer (reward.py). The pool, the
held-out set and the warm start's SFT data are drawn from seeds RG_SPLIT apart (reasoning-gym
draws item i from seed + i), and held-out items whose question the pool or the SFT data hold are
dropped. meta["difficulty"] is the item's value of the first knob its generator ranges over
(chain_sum: the number of terms; countdown: how many numbers), where that is a whole number.

Simplifications:
    1. A dataset without its own test split (a local file) holds out its last n_eval rows.
    2. Prompts longer than the context (minus max_new_tokens) are dropped and counted.
    3. The synthetic task's tokenizer is one token per character; the real models bring their own.
    4. Local .jsonl/.json files are read here, line by line (a .json file may also be one array of
       objects); hub names and .parquet files go through `datasets`.
    5. A reasoning-gym item with no reference answer is a malformed row: generators that leave
       every answer out (rush_hour, graph_color, ...: any valid answer scores) are not supported.
       For the character tokenizer, items that use a character it lacks (gsm_symbolic's "€") are
       skipped and counted the same way; the real models' tokenizers take any text.

`python -m pytest -q tests/test_prompts.py tests/test_data.py tests/test_reasoning_gym.py` checks
the tasks and the loaders.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import string
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Iterable, Iterator, NamedTuple, Optional, Sequence,
                    Union)

from answers import extract_boxed, extract_hash_answer
from config import MARKED_VARS, RG_PREFIX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TASKS = ("synthetic", "gsm8k", "math", "code", "reasoning_gym")
ORDERS = ("defined", "shuffled", "marked", "lagged")  # the synthetic task's variants
GSM8K_INSTRUCTION = ("\nSolve the problem step by step, then end with a line of the form "
                     "\"#### <answer>\".")
MATH_INSTRUCTION = "\nSolve the problem step by step, and put the final answer in \\boxed{}."
CODE_INSTRUCTION = "\nWrite the complete Python code in a ```python code block."
RG_INSTRUCTION = "\nEnd with \"#### \" and the final answer."
RG_SPLIT = 1_000_000_000  # reasoning-gym seeds of the pool, the held-out set and the SFT data


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
    # every rank of a torchrun job calls this on the same folder: each writes a private copy, reads
    # it back, then renames its files into place one by one (same bytes, so any order is complete)
    os.makedirs(out_dir, exist_ok=True)
    mine = tempfile.mkdtemp(dir=out_dir, prefix=".tmp-")
    fast.save_pretrained(mine)
    tok = AutoTokenizer.from_pretrained(mine)
    for name in os.listdir(mine):
        os.replace(os.path.join(mine, name), os.path.join(out_dir, name))
    os.rmdir(mine)
    return tok


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


def make_reasoning_gym(name: str, n: int, seed: int, kwargs: Optional[dict] = None,
                       chars: Optional[str] = None, prompt: str = "question") -> list[Problem]:
    """n items of reasoning-gym's generator `name`, with its settings `kwargs`, as Problems: item i
    is drawn from seed + i, so the same arguments give the same problems. Items with no usable
    question or answer, and (with `chars`, the character tokenizer's) items that use a character
    outside `chars`, are skipped with one warning that counts them (ValueError if none is left).
    prompt "expression": the metadata's expression and "=" ("47+35-19="); "last_paragraph": the
    question's last paragraph (and the instruction)."""
    import reasoning_gym  # lazy: 1.5 s to import, and only these tasks need it

    kwargs = dict(kwargs or {})
    data = reasoning_gym.create_dataset(name, size=n, seed=seed, **kwargs)
    known = set(chars) if chars is not None else None

    def parse(item, i):
        q, why = _text_field(item, "question")
        if why:
            return None, why
        a, why = _text_field(item, "answer")
        if why:
            return None, why
        lacks = sorted(set(q + a) - known) if known is not None else []
        if lacks:  # the char tokenizer would read them as <unk>: no model could write them
            return None, f"characters the character tokenizer lacks {''.join(lacks)!r}"
        meta = {"rg_name": name, "rg_kwargs": kwargs, "entry": item, "index": i}
        d = _rg_difficulty(item.get("metadata"))
        if d is not None:
            meta["difficulty"] = d
        if prompt == "expression":  # config.check_task: the expression is the question
            return Problem(item["metadata"]["expression"].replace(" ", "") + "=", a,
                           "reasoning_gym", meta), None
        q = q.strip().split("\n\n")[-1] if prompt == "last_paragraph" else q  # config.check_task
        return Problem(q.strip() + RG_INSTRUCTION, a, "reasoning_gym", meta), None

    return _collect((data[i] for i in range(n)), parse, RG_PREFIX + name, None)


def _rg_difficulty(metadata) -> Optional[int]:
    """The item's value of the first knob its generator ranges over (metadata["difficulty"] names
    them, as ranges); a list counts its items. None where that is not a whole number."""
    knobs = metadata.get("difficulty") if isinstance(metadata, dict) else None
    if isinstance(knobs, dict) and knobs:
        value = metadata.get(next(iter(knobs)))
    else:  # gsm_symbolic: one number
        value = knobs
    value = len(value) if isinstance(value, (list, tuple)) else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        return None
    return int(value)


# ---------------------------------------------------------------------------------------------
# A config's problems and their token ids.

def sft_seed(cfg) -> int:
    """The warm start's seed: config key sft_seed, or seed where that is -1."""
    return cfg.sft_seed if cfg.sft_seed >= 0 else cfg.seed


def sft_problems(cfg) -> list[Problem]:
    """The synthetic warm start's SFT data (its prompts; the teacher writes the traces)."""
    if cfg.task.startswith(RG_PREFIX):
        return make_reasoning_gym(cfg.task[len(RG_PREFIX):], cfg.sft_steps * cfg.sft_batch,
                                  sft_seed(cfg) + 2 * RG_SPLIT, {**cfg.rg_kwargs,
                                  **cfg.sft_rg_kwargs}, CHARS, cfg.rg_prompt)
    return make_synthetic(cfg.sft_steps * cfg.sft_batch, sft_seed(cfg) + 20_000,
                          cfg.sft_difficulty or cfg.difficulty, cfg.order)


def load_problems(cfg) -> tuple[list[Problem], list[Problem]]:
    """-> (training pool, held-out problems) for config keys task, data, n_train, n_eval,
    difficulty, eval_difficulty, order, rg_kwargs (eval_rg_kwargs over it for the held-out set),
    rg_prompt. Synthetic and reasoning-gym held-out problems
    share no prompt with the pool or, for the embedded warm start, with its SFT data: held out
    means never trained on."""
    if cfg.task.startswith(RG_PREFIX):  # the tiny model reads characters: only those it knows
        name, chars = cfg.task[len(RG_PREFIX):], None if cfg.model else CHARS
        pool = make_reasoning_gym(name, cfg.n_train or 20_000, cfg.seed, cfg.rg_kwargs, chars,
                                  cfg.rg_prompt)
        seen = {p.prompt for p in pool + ([] if cfg.model else sft_problems(cfg))}
        fresh = []  # twice as many drawn: small generators repeat questions
        for p in make_reasoning_gym(name, 2 * cfg.n_eval + 100, cfg.seed + RG_SPLIT,
                                    {**cfg.rg_kwargs, **cfg.eval_rg_kwargs}, chars, cfg.rg_prompt):
            if p.prompt not in seen:
                seen.add(p.prompt)  # no question twice in the held-out set either
                fresh.append(p)
        return pool, fresh[:cfg.n_eval]
    if cfg.task == "synthetic":
        pool = make_synthetic(cfg.n_train or 20_000, cfg.seed, cfg.difficulty, cfg.order)
        seen = {p.prompt for p in pool + ([] if cfg.model else sft_problems(cfg))}
        fresh = [p for p in make_synthetic(2 * cfg.n_eval + 100, cfg.seed + 10_000,
                                           cfg.eval_difficulty or cfg.difficulty, cfg.order)
                 if p.prompt not in seen]  # twice as many drawn: short chains repeat often
        return pool, fresh[:cfg.n_eval]
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
