"""Tasks and datasets -> a pool of Problems, and a sampler over that pool.

Stage 1: the embedded synthetic task (no downloads), a character-level tokenizer for it, GSM8K and
MATH loaders (hub names or local .jsonl/.json/.parquet files), and uniform sampling without
replacement. PromptSampler keeps `observe()` and `_epoch_order()` as seams for a later sampler
that tracks pass rates.
"""
from __future__ import annotations

import os
import random
import string
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

from reward import extract_boxed, extract_hash_answer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TASKS = ("synthetic", "gsm8k", "math")
GSM8K_INSTRUCTION = "\nSolve the problem step by step, then end with a line of the form \"#### <answer>\"."
MATH_INSTRUCTION = "\nSolve the problem step by step, and put the final answer in \\boxed{}."


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


def make_synthetic(n: int, seed: int, difficulty: Union[int, tuple[int, int]] = (1, 8)) -> list[Problem]:
    """n problems, deterministic from `seed`; each draws d uniformly from the inclusive `difficulty` range.

    d is the number of terms to add (n_vars = min(26, d + 2) variables to look up from).
    """
    lo, hi = (difficulty, difficulty) if isinstance(difficulty, int) else tuple(difficulty)
    if lo < 1 or hi < lo:
        raise ValueError(f"difficulty must be an int >= 1 or a range (lo, hi) with 1 <= lo <= hi, got {difficulty!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.randint(lo, hi)
        names = rng.sample(string.ascii_lowercase, min(26, d + 2))
        values = {name: rng.randint(0, 9) for name in names}
        # distinct terms while there are enough names (each step is then one unambiguous lookup), repeats beyond
        terms = rng.sample(names, d) if d <= len(names) else [rng.choice(names) for _ in range(d)]
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
    """One token per character, no BOS/EOS added, exact decode round-trip; saved to out_dir and reloaded.

    Unknown characters map to "<unk>". Note: the literal texts "<pad>", "<eos>", "<unk>" in an
    input are read as the special tokens themselves, not as five characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, "\n" too
    tk.decoder = decoders.Fuse()  # concatenate; the default would join tokens with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # would otherwise rewrite " ." -> "." on decode
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


def format_prompt(tokenizer, problem: Problem, chat_template: bool) -> str:
    """The text to feed the policy: the chat-templated user turn if asked for and available, else the raw prompt."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.prompt}], tokenize=False, add_generation_prompt=True
        )
    return problem.prompt


# ---------------------------------------------------------------------------------------------
# GSM8K / MATH loaders.

def _load_rows(source: str, split: str, config: Optional[str]):
    import datasets

    if os.path.isfile(source) and source.endswith((".jsonl", ".json", ".parquet")):
        kind = "parquet" if source.endswith(".parquet") else "json"
        return datasets.load_dataset(kind, data_files=source, split="train")
    if config is None:
        return datasets.load_dataset(source, split=split)
    return datasets.load_dataset(source, config, split=split)


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


def _collect(rows: Iterable[dict], parse, name: str, limit: Optional[int]) -> list[Problem]:
    """Parse rows with `parse(row, i) -> (Problem | None, reason | None)`; warn once about skipped rows."""
    good, skipped, total = [], Counter(), 0
    for i, row in enumerate(rows):
        if limit is not None and len(good) >= limit:
            break
        total += 1
        prob, reason = parse(row, i)
        if prob is None:
            skipped[reason] += 1
        else:
            good.append(prob)
    if skipped:
        detail = ", ".join(f"{r}: {c}" for r, c in skipped.items())
        msg = f"{name}: skipped {sum(skipped.values())} of {total} malformed rows: {detail}"
        if not good:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
    return good


def problems_from_gsm8k_rows(rows: Iterable[dict], name: str = "gsm8k", limit: Optional[int] = None) -> list[Problem]:
    """GSM8K-schema rows ({"question", "answer": "... #### 72"}) -> Problems; malformed rows skipped with a warning."""
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
        return Problem(q.strip() + GSM8K_INSTRUCTION, gold, "gsm8k", {"solution": a, "index": i}), None

    return _collect(rows, parse, name, limit)


def problems_from_math_rows(rows: Iterable[dict], name: str = "math", limit: Optional[int] = None) -> list[Problem]:
    """MATH-schema rows -> Problems. The answer is the row's `answer` field when present (MATH-500),
    else the last \\boxed{} of `solution`. level/type/subject are kept in meta."""
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


def load_gsm8k(source: str = "openai/gsm8k", split: str = "train", limit: Optional[int] = None) -> list[Problem]:
    """GSM8K from the hub (config "main") or a local .jsonl/.json/.parquet file in the same schema."""
    return problems_from_gsm8k_rows(_load_rows(source, split, "main"), f"gsm8k ({source})", limit)


def load_math(source: str = "DigitalLearningGmbH/MATH-lighteval", split: str = "train",
              limit: Optional[int] = None) -> list[Problem]:
    """MATH (or MATH-500 style, with an `answer` column) from the hub or a local file."""
    return problems_from_math_rows(_load_rows(source, split, None), f"math ({source})", limit)


# ---------------------------------------------------------------------------------------------
# Sampling.

class PromptSampler:
    """Uniform sampling without replacement within an epoch, reshuffled each epoch.

    The order of epoch e is a pure function of (seed, e), so the state is just (epoch, position)
    and a resumed sampler continues with exactly the same sequence. A batch that runs past the end
    of an epoch continues into the next one.
    """

    def __init__(self, problems: Sequence[Problem], seed: int):
        if len(problems) == 0:
            raise ValueError("PromptSampler needs at least one problem")
        self.problems = list(problems)
        self.seed = int(seed)
        self.epoch = 0
        self.pos = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        """The visiting order of an epoch (a seam for a later pass-rate-weighted sampler)."""
        order = list(range(len(self.problems)))
        random.Random(f"zeros-sampler:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[tuple[int, Problem]]:
        """The next n (index into problems, Problem) pairs."""
        out = []
        while len(out) < n:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            i = self._order[self.pos]
            self.pos += 1
            out.append((i, self.problems[i]))
        return out

    def observe(self, indices: Sequence[int], rewards: Sequence[float]) -> None:
        """Hook for per-prompt outcomes after scoring; a no-op for uniform sampling."""

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos, "n_problems": len(self.problems)}

    def load_state_dict(self, sd: dict) -> None:
        if sd["n_problems"] != len(self.problems):
            raise ValueError(f"sampler state is for {sd['n_problems']} problems, this pool has {len(self.problems)}")
        self.seed, self.epoch, self.pos = int(sd["seed"]), int(sd["epoch"]), int(sd["pos"])
        self._order = self._epoch_order(self.epoch)
