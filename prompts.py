"""Stage 1, sparse signal: tasks and datasets -> a pool of Problems, and which prompts to train on.

A prompt the policy always solves, or never solves, gives a group of equal rewards: zero advantage,
no gradient, only cost. The growth zone is what lies between. This file holds:
  - the tasks: the embedded synthetic task (no downloads) and its character tokenizer; GSM8K, MATH
    and MBPP (code, task "code") loaders, from hub names or local .jsonl/.json/.parquet files;
  - PromptSampler: uniform, without replacement within an epoch (the baseline);
  - PassRates and GrowthZoneSampler: a decayed Beta posterior per prompt, and Thompson draws that
    fill most of the batch from the zone while the rest explores the prompts picked longest ago;
  - group_has_signal: DAPO's test for a group worth training on (the refill loop is train.py's).

Simplifications:
  1. A pass is a reward >= threshold; the posterior ignores how far above or below it a reward is.
  2. Forgetting counts observations, not time: a prompt nobody picks keeps its estimate until the
     exploration (or a lucky draw) brings it back.
  3. The prior is fixed (Beta(1, 1) by default), not fitted to the pool.
  4. Exploitation is uniform within the zone; it does not prefer pass rates near 1/2.

    sampler = GrowthZoneSampler(problems, seed=0, zone=(0.1, 0.9), explore=0.1)
    batch = sampler.next_batch(32)                        # [(index, Problem)]
    sampler.observe([i for i, _ in batch], rewards)       # rewards: one list per group
    sampler.stats()                                       # {"zone": .., "unseen": .., ...}

`python -m pytest -q tests/test_sampler.py` runs it on a simulated pool with known pass rates.
"""
from __future__ import annotations

import os
import random
import string
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from reward import extract_boxed, extract_hash_answer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TASKS = ("synthetic", "gsm8k", "math", "code")
GSM8K_INSTRUCTION = "\nSolve the problem step by step, then end with a line of the form \"#### <answer>\"."
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
    pool = list(string.ascii_lowercase) if k <= 26 else [x + y for x in string.ascii_lowercase for y in string.ascii_lowercase]
    if k > len(pool):
        raise ValueError(f"the synthetic task supports at most {len(pool)} variables, asked for {k}")
    return rng.sample(pool, k)


def make_synthetic(n: int, seed: int, difficulty: Union[int, tuple[int, int]] = (1, 8),
                   order: str = "defined") -> list[Problem]:
    """n problems, deterministic from `seed`; each draws d uniformly from the inclusive `difficulty` range.

    d is the number of terms to add. `order` sets how hard each lookup is:
      "defined":  d variables, summed in the order they are defined (the value to look up sits at a position
                  that moves steadily through the prompt: a small model learns it in a few hundred SFT steps);
      "shuffled": d of d + 2 variables, summed in a random order (each lookup must match the name itself:
                  much harder for a small model).
    """
    lo, hi = (difficulty, difficulty) if isinstance(difficulty, int) else tuple(difficulty)
    if lo < 1 or hi < lo:
        raise ValueError(f"difficulty must be an int >= 1 or a range (lo, hi) with 1 <= lo <= hi, got {difficulty!r}")
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


def problems_from_mbpp_rows(rows: Iterable[dict], name: str = "mbpp", limit: Optional[int] = None) -> list[Problem]:
    """MBPP-schema rows -> code Problems. The prompt shows the first test (after the setup code, if
    any) as an example; the answer is the reference code; meta keeps task_id, test_list,
    test_setup_code and challenge_test_list, which the reward's sandbox stage runs."""
    def parse(row, i):
        text, why = _text_field(row, "text")
        if why:
            return None, why
        code, why = _text_field(row, "code")
        if why:
            return None, why
        tests, setup = row.get("test_list"), row.get("test_setup_code") or ""
        if not (isinstance(tests, (list, tuple)) and tests and all(isinstance(t, str) and t.strip() for t in tests)):
            return None, "no usable 'test_list'"
        if not isinstance(setup, str):
            return None, "non-string 'test_setup_code'"
        example = f"{setup.strip()}\n{tests[0]}" if setup.strip() else tests[0]  # the test may use names set up there
        prompt = f"{text.strip()}\nYour code should pass this test:\n{example}{CODE_INSTRUCTION}"
        meta = {"task_id": row.get("task_id"), "test_list": list(tests), "test_setup_code": setup,
                "challenge_test_list": list(row.get("challenge_test_list") or []), "index": i}
        return Problem(prompt, code, "code", meta), None

    return _collect(rows, parse, name, limit)


def load_mbpp(source: str = "google-research-datasets/mbpp", split: str = "train",
              limit: Optional[int] = None) -> list[Problem]:
    """MBPP ("full" config: text, code, test_list, ...) from the hub or a local file in that schema."""
    return problems_from_mbpp_rows(_load_rows(source, split, None), f"mbpp ({source})", limit)


# ---------------------------------------------------------------------------------------------
# Sampling.

class PromptSampler:
    """Uniform sampling without replacement within an epoch, reshuffled each epoch (the baseline).

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
        """The visiting order of an epoch."""
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

    def stats(self) -> dict:
        return {}  # nothing tracked; GrowthZoneSampler reports the zone here

    def state_dict(self) -> dict:
        return {"kind": "uniform", "seed": self.seed, "epoch": self.epoch, "pos": self.pos,
                "n_problems": len(self.problems)}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind", "uniform") != "uniform":
            raise ValueError(f"PromptSampler.load_state_dict: this state is from another sampler "
                             f"(kind={sd['kind']!r}); a run cannot switch samplers on resume")
        if sd["n_problems"] != len(self.problems):
            raise ValueError(f"sampler state is for {sd['n_problems']} problems, this pool has {len(self.problems)}")
        self.seed, self.epoch, self.pos = int(sd["seed"]), int(sd["epoch"]), int(sd["pos"])
        self._order = self._epoch_order(self.epoch)


# ---------------------------------------------------------------------------------------------
# Pass rates, the growth zone, and DAPO's dynamic-sampling test.

class PassRates:
    """A Beta posterior over each prompt's pass rate: Beta(a + s_i, b + f_i), in numpy arrays.

    s_i and f_i are decayed counts of passes and fails: each observation of prompt i first
    multiplies them by `decay` (a step back toward the prior), then adds the group's passes and
    fails. So they stay below G / (1 - decay), and a new group always moves the estimate by a fixed
    share: an estimate never freezes. A reward >= `threshold` is a pass (non-binary rewards too).
    """

    def __init__(self, n: int, prior: tuple = (1.0, 1.0), decay: float = 0.8, threshold: float = 0.5):
        if len(prior) != 2 or not (prior[0] > 0 and prior[1] > 0):
            raise ValueError(f"PassRates: prior must be (a, b) with a, b > 0, got {prior!r}")
        if not 0 < decay <= 1:
            raise ValueError(f"PassRates: decay must be in (0, 1], got {decay!r}")
        self.a, self.b, self.decay, self.threshold = float(prior[0]), float(prior[1]), float(decay), float(threshold)
        self.s, self.f = np.zeros(n), np.zeros(n)  # decayed pass and fail counts
        self.visits = np.zeros(n, dtype=np.int64)  # groups observed, never decayed

    def observe(self, indices: Sequence[int], groups: Sequence[np.ndarray]) -> None:
        for i, r in zip(indices, groups):  # one Python step per group, never per prompt of the pool
            if not np.isfinite(r).all():
                raise ValueError(f"PassRates: the rewards of prompt {i} are not all finite: {r.tolist()}")
            passes = float((r >= self.threshold).sum())
            self.s[i] = self.decay * self.s[i] + passes
            self.f[i] = self.decay * self.f[i] + (r.size - passes)
            self.visits[i] += 1

    def mean(self) -> np.ndarray:
        return (self.a + self.s) / (self.a + self.b + self.s + self.f)

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """One Thompson draw of every prompt's pass rate."""
        return rng.beta(self.a + self.s, self.b + self.f)


class GrowthZoneSampler:
    """Prompts in the growth zone: not always solved (no gain), not never solved (no reward).

    Each batch, vectorised over the whole pool:
      1. draw every prompt's pass rate from its posterior (Thompson sampling). An unseen prompt
         draws from the prior, so it is a candidate as often as the prior puts it in the zone; a
         prompt failed in its last groups still lands in the zone now and then, the more often the
         less evidence there is;
      2. exploit, about (1 - explore) of the batch: uniformly among the prompts whose draw lies in
         `zone` and that were not picked in the last `cooldown` steps. Known-easy and known-hard
         prompts are skipped; on a small pool the zone's prompts come back often;
      3. explore, the rest (and exploit slots with no candidate): the prompts picked longest ago,
         never-picked first, ties at random. Every prompt comes back within about
         pool / (batch * explore) steps, so a prompt too hard yesterday is tried again today.
    A batch has no repeats unless it is larger than the pool. Same interface as PromptSampler;
    state_dict() holds the counts and the random state, so a resumed run draws the same batches.
    stats() describes the last batch. Every rank must observe() the whole batch, or ranks diverge.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, zone: tuple = (0.1, 0.9), explore: float = 0.1,
                 prior: tuple = (1.0, 1.0), decay: float = 0.8, threshold: float = 0.5, cooldown: int = 0):
        if len(problems) == 0:
            raise ValueError("GrowthZoneSampler needs at least one problem")
        if len(zone) != 2 or not 0 <= zone[0] < zone[1] <= 1:
            raise ValueError(f"GrowthZoneSampler: zone must be (lo, hi) with 0 <= lo < hi <= 1, got {zone!r}")
        if not 0 <= explore <= 1:
            raise ValueError(f"GrowthZoneSampler: explore must be in [0, 1], got {explore!r}")
        if not isinstance(cooldown, int) or cooldown < 0:
            raise ValueError(f"GrowthZoneSampler: cooldown must be an int >= 0, got {cooldown!r}")
        self.problems, self.seed = list(problems), int(seed)
        self.lo, self.hi, self.explore, self.cooldown = float(zone[0]), float(zone[1]), float(explore), cooldown
        self.rates = PassRates(len(self.problems), prior, decay, threshold)
        self.rng = np.random.default_rng(self.seed)
        self.step = 0
        self.last_pick = np.full(len(self.problems), -1, dtype=np.int64)  # -1: never picked
        self._stats: dict = {}

    def next_batch(self, n: int) -> list[tuple[int, Problem]]:
        """The next n (index into problems, Problem) pairs."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"next_batch: n must be an int >= 1, got {n!r}")
        mean, seen = self.rates.mean(), self.rates.visits > 0  # before this batch, for stats()
        picks, explored = [], 0
        while len(picks) < n:  # a batch larger than the pool takes it in rounds
            batch, k_explore = self._pick(min(n - len(picks), len(self.problems)))
            picks += batch.tolist()
            explored += k_explore
        self.step += 1
        self._stats.update(self._pool_stats(mean, seen), zone=float(np.mean(self._in_zone(mean[picks]) & seen[picks])),
                           unseen=float(np.mean(~seen[picks])), explored=explored / n)
        return [(i, self.problems[i]) for i in picks]

    def _pick(self, k: int) -> tuple[np.ndarray, int]:
        """k distinct prompts (k <= pool size) and how many of them came from exploration."""
        rng, N = self.rng, len(self.problems)
        theta = self.rates.draw(rng)  # (N,)
        ok = self._in_zone(theta) & (self.step - self.last_pick > self.cooldown)
        cand = np.flatnonzero(ok)
        k_zone = min(k - int(rng.binomial(k, self.explore)), cand.size)
        zone = rng.choice(cand, size=k_zone, replace=False) if k_zone else np.empty(0, dtype=np.int64)
        staleness = self.last_pick + rng.random(N)  # the oldest pick first; the fraction breaks ties at random
        staleness[zone] = np.inf
        m = k - k_zone
        explore = np.argpartition(staleness, m - 1)[:m] if m else np.empty(0, dtype=np.int64)
        batch = rng.permutation(np.concatenate([zone, explore]))
        self.last_pick[batch] = self.step
        return batch, m

    def _in_zone(self, p: np.ndarray) -> np.ndarray:
        return (p >= self.lo) & (p <= self.hi)

    def _pool_stats(self, mean: np.ndarray, seen: np.ndarray) -> dict:
        n_seen = max(1, int(seen.sum()))
        return {"pool_seen": float(seen.mean()), "pool_zone": float((self._in_zone(mean) & seen).sum()) / n_seen,
                "pool_easy": float(((mean > self.hi) & seen).sum()) / n_seen,
                "pool_hard": float(((mean < self.lo) & seen).sum()) / n_seen}

    def observe(self, indices: Sequence[int], rewards: Sequence) -> None:
        """rewards[k]: the rewards of the group of prompt indices[k] (a list), or a single float."""
        if len(indices) != len(rewards):
            raise ValueError(f"observe: {len(indices)} indices but {len(rewards)} reward groups")
        idx = [int(i) for i in indices]
        bad = [i for i in idx if not 0 <= i < len(self.problems)]
        if bad:
            raise IndexError(f"observe: prompt indices {bad[:5]} outside the pool of {len(self.problems)}")
        groups = [np.atleast_1d(np.asarray(r, dtype=np.float64)).reshape(-1) for r in rewards]
        self.rates.observe(idx, groups)
        rates = np.array([float((g >= self.rates.threshold).mean()) if g.size else np.nan for g in groups])
        self._stats["zone_obs"] = float(self._in_zone(rates).mean()) if len(rates) else 0.0

    def stats(self) -> dict:
        """The last batch: zone (share whose estimated pass rate was in the zone), unseen (never
        observed before), explored (picked by exploration), zone_obs (share of the observed groups
        whose pass rate fell in the zone); the pool: pool_seen, and among the seen prompts
        pool_zone, pool_easy (above the zone), pool_hard (below it)."""
        return dict(self._stats)

    def state_dict(self) -> dict:
        r = self.rates
        arrays = {k: torch.from_numpy(v.copy()) for k, v in
                  (("s", r.s), ("f", r.f), ("visits", r.visits), ("last_pick", self.last_pick))}
        return {"kind": "growth_zone", "n_problems": len(self.problems), "seed": self.seed, "step": self.step,
                "rng": self.rng.bit_generator.state, "stats": dict(self._stats), **arrays}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "growth_zone":
            raise ValueError("GrowthZoneSampler.load_state_dict: this state is not from a GrowthZoneSampler "
                             f"(kind={sd.get('kind')!r}); a run cannot switch samplers on resume")
        if sd["n_problems"] != len(self.problems):
            raise ValueError(f"sampler state is for {sd['n_problems']} problems, this pool has {len(self.problems)}")
        self.seed, self.step, self._stats = int(sd["seed"]), int(sd["step"]), dict(sd["stats"])
        self.rng.bit_generator.state = sd["rng"]
        self.rates.s, self.rates.f = sd["s"].numpy().astype(np.float64), sd["f"].numpy().astype(np.float64)
        self.rates.visits = sd["visits"].numpy().astype(np.int64)
        self.last_pick = sd["last_pick"].numpy().astype(np.int64)


def group_has_signal(rewards, min_spread: float = 0.0, spread: str = "range") -> bool:
    """DAPO's dynamic-sampling test: do a group's rewards differ enough to give a nonzero advantage?

    spread "range" is max - min, "std" the population standard deviation; the group has signal
    when it is > min_spread. A binary group has it when it mixes 0s and 1s; with non-binary
    rewards, min_spread drops groups that differ only by noise ([0.50, 0.52] has range 0.02).
    A group of fewer than two completions has none. Accepts a list, an array or a CPU tensor.
    """
    if spread not in ("range", "std"):
        raise ValueError(f"group_has_signal: spread must be 'range' or 'std', got {spread!r}")
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if not np.isfinite(r).all():
        raise ValueError(f"group_has_signal: rewards must be finite, got {r.tolist()}")
    if r.size < 2:
        return False
    r = r - r[0]  # equal rewards become exact zeros, so their std is exactly 0, not a rounding error
    return bool((r.max() - r.min() if spread == "range" else r.std()) > min_spread)
