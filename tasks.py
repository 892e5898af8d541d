"""
tasks.py: what the policy is asked. No stage of its own: every stage reads these Problems.

    from tasks import load_problems, make_synthetic
    train, held_out = load_problems(cfg)          # the pool and the held-out set of a config
    make_synthetic(4, seed=0, difficulty=(2, 3))  # [Problem("c=4,a=7?a+c\\n", "1", ...), ...]

What is here:
    Problem            a prompt, its reference answer, its task and its meta (tests, difficulty)
    the synthetic task running sums mod 10 over named values, or over a stream (synthetic.py, all
                       re-exported here), and the character tokenizer of the tiny model
    loaders            GSM8K, MATH and MBPP (code), from hub names or local .jsonl/.json/.parquet
                       files; malformed rows (not UTF-8, not JSON, not an object, a field missing)
                       are skipped with one warning that counts them and names the file and lines
    reasoning-gym      its procedural generators (chain_sum, countdown, gsm_symbolic, ... over
                       100), offline; each item keeps its entry for the library's score_answer
    load_problems / encode_pool   a config's pool and held-out set (synthetic, reasoning-gym:
                       disjoint from the pool and the warm start's SFT data by prompt), and their
                       token ids
    format_prompt / end_ids   a real model's chat template (with thinking off where chat_thinking
                       says so), and every token id that ends a completion (Qwen3 has two)
How an answer is read back and compared with the reference is answers.py's.

reasoning-gym tasks: `task="reasoning_gym:<name>"`, the generator's settings in `rg_kwargs`
(config.py checks both when the config is parsed), e.g.

    python train.py configs/countdown_qwen3.py
    make_reasoning_gym("chain_sum", 4, seed=0, kwargs={"min_terms": 2, "max_terms": 3})

A problem's prompt is the item's question and RG_INSTRUCTION ("####" then the answer: answers.py
reads what follows the last "####"); its answer is the item's, and meta["entry"] the whole item,
which the reward's last stage hands to the library's score_answer (reward.py). rg_prompt
"expression" makes the prompt chain_sum's expression alone ("7-3+5="), and "aligned" lays it out
for the character model (aligned_prompt): one cell of ALIGN characters a term, as many cells as
the run's longest sum (rg_width), so every prompt of a run has one length and the trace
(warmstart.chain_sum_trace), written in cells of the same size, reads term k at one distance.
The pool, the held-out set and the warm start's SFT data are drawn from seeds RG_SPLIT apart
(reasoning-gym draws item i from seed + i), and held-out items whose question the pool or the SFT
data hold are dropped. meta["difficulty"] is the item's value of the first knob its generator ranges over
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
import tempfile
import warnings
from collections import Counter
from typing import (TYPE_CHECKING, Iterable, Iterator, NamedTuple, Optional, Sequence,
                    Union)

from answers import extract_boxed, extract_hash_answer
from config import RG_BINS, RG_PREFIX
from synthetic import (LAG_LINES, LAG_WIDTH, ORDERS, Problem, is_lagged,  # noqa: F401
                       lagged_trace, make_synthetic, synthetic_trace)  # (re-exported)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TASKS = ("synthetic", "gsm8k", "math", "code", "reasoning_gym")
GSM8K_INSTRUCTION = ("\nSolve the problem step by step, then end with a line of the form "
                     "\"#### <answer>\".")
MATH_INSTRUCTION = "\nSolve the problem step by step, and put the final answer in \\boxed{}."
CODE_INSTRUCTION = "\nWrite the complete Python code in a ```python code block."
RG_INSTRUCTION = "\nEnd with \"#### \" and the final answer."
RG_SPLIT = 1_000_000_000  # reasoning-gym seeds of the pool, the held-out set and the SFT data
BIN_SEEDS = 10_000_000  # eval_per_bin: the held-out seeds of difficulty d start d * BIN_SEEDS in
PER_BIN_DRAWS = 64  # eval_per_bin: at most this many draws per problem wanted, in each bin


# ---------------------------------------------------------------------------------------------
# Character-level tokenizer for the synthetic task.

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2
ALIGN = 4  # rg_prompt "aligned": characters per term (a sign, a digit, two blanks)
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


def format_prompt(tokenizer, problem: Problem, chat_template: bool, thinking: bool = True) -> str:
    """The text to feed the policy: the chat-templated user turn if asked for and available, else
    the raw prompt. thinking=False renders the template with enable_thinking=False (config key
    chat_thinking; Qwen3's template then closes an empty <think></think> block itself)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        off = {} if thinking else {"enable_thinking": False}  # a template variable, not a flag
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.prompt}], tokenize=False,
            add_generation_prompt=True, **off)
    return problem.prompt


def end_ids(tokenizer, source: str, own=None) -> list:
    """Every token id that ends a completion: the tokenizer's EOS, the model config's eos_token_id
    (`own`, an id or a list) and its generation config's, read from `source` (a model folder or a
    Hub name; Qwen3's generation_config.json adds <|endoftext|> to the tokenizer's <|im_end|>)."""
    ids = [tokenizer.eos_token_id, *(own if isinstance(own, (list, tuple)) else [own])]
    try:  # lazy: transformers takes seconds to import
        from transformers import GenerationConfig
        gen = GenerationConfig.from_pretrained(source).eos_token_id
        ids += gen if isinstance(gen, (list, tuple)) else [gen]
    except (OSError, ValueError):  # no generation_config.json: the others are all there is
        pass
    return [i for i in dict.fromkeys(ids) if i is not None]


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
                       chars: Optional[str] = None, prompt: str = "question",
                       width: int = 0) -> list[Problem]:
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
        if prompt == "aligned":  # checks.check_task: a chain_sum expression, `width` terms
            return Problem(aligned_prompt(item["metadata"]["expression"], width), a,
                           "reasoning_gym", meta), None
        if prompt == "expression":  # checks.check_task: the expression is the question
            return Problem(item["metadata"]["expression"].replace(" ", "") + "=", a,
                           "reasoning_gym", meta), None
        q = q.strip().split("\n\n")[-1] if prompt == "last_paragraph" else q  # checks.check_task
        return Problem(q.strip() + RG_INSTRUCTION, a, "reasoning_gym", meta), None

    return _collect((data[i] for i in range(n)), parse, RG_PREFIX + name, None)


def aligned_prompt(expression: str, width: int) -> str:
    """A chain_sum expression laid out in cells of ALIGN characters, each term signed, blank cells
    up to `width` terms, then "=": "7 - 3 + 5" -> "+7  -3  +5  " + blanks + "=". Every prompt
    of a run has one length, so a trace written in cells of the same size (warmstart.
    chain_sum_trace) reads term k at one distance from its step k, at any number of terms."""
    parts = expression.split()
    cells = [f"+{parts[0]}"] + [op + t for op, t in zip(parts[1::2], parts[2::2])]
    if len(cells) > width or max(len(c) for c in cells) > ALIGN - 1:
        raise ValueError(f"aligned prompt: {expression!r} does not fit {width} cells of {ALIGN}")
    return "".join(c.ljust(ALIGN) for c in cells).ljust(ALIGN * width) + "="


def rg_width(cfg) -> int:
    """rg_prompt "aligned": the cells every prompt has, the most terms of the pool, the SFT data
    and the held-out set."""
    return max(d.get("max_terms", 6) for d in (cfg.rg_kwargs, {**cfg.rg_kwargs, **cfg.sft_rg_kwargs},
                                                {**cfg.rg_kwargs, **cfg.eval_rg_kwargs}))


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
                                  **cfg.sft_rg_kwargs}, CHARS, cfg.rg_prompt, rg_width(cfg))
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
                                  cfg.rg_prompt, rg_width(cfg))
        seen = {p.prompt for p in pool + ([] if cfg.model else sft_problems(cfg))}
        if cfg.eval_per_bin:  # difficulty by difficulty
            return pool, per_bin_problems(cfg, name, chars, seen)
        fresh = []  # twice as many drawn: small generators repeat questions
        for p in make_reasoning_gym(name, 2 * cfg.n_eval + 100, cfg.seed + RG_SPLIT,
                                    {**cfg.rg_kwargs, **cfg.eval_rg_kwargs}, chars, cfg.rg_prompt,
                                    rg_width(cfg)):
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


def per_bin_problems(cfg, name: str, chars: Optional[str], seen: set) -> list[Problem]:
    """config key eval_per_bin: the held-out set drawn difficulty by difficulty, each from the
    generator pinned to it (checks.RG_BINS), eval_per_bin problems whose prompt `seen` (the pool,
    the SFT data) lacks, none twice. Where fewer exist (chain_sum's sums of 2 and 3 terms: 200 and
    4,000 in all, most of them in the pool or the SFT data) it keeps as many as rounds of doubling
    draws find, up to PER_BIN_DRAWS times eval_per_bin draws."""
    from reasoning_gym.factory import DATASETS  # lazy, as in make_reasoning_gym
    kw = {**cfg.rg_kwargs, **cfg.eval_rg_kwargs}
    lo, hi = RG_BINS[name]
    want, out = cfg.eval_per_bin, []
    for d in range(kw.get(lo, getattr(DATASETS[name][1](), lo)),
                   kw.get(hi, getattr(DATASETS[name][1](), hi)) + 1):
        got, drawn, n = [], 0, 2 * want + 50
        while len(got) < want and drawn < PER_BIN_DRAWS * want:
            for p in make_reasoning_gym(name, n, cfg.seed + RG_SPLIT + d * BIN_SEEDS + drawn,
                                        {**kw, lo: d, hi: d}, chars, cfg.rg_prompt, rg_width(cfg)):
                if p.prompt not in seen and len(got) < want:
                    seen.add(p.prompt)
                    got.append(p)
            drawn, n = drawn + n, 2 * n
        out += got
    return out


def encode_pool(tok, problems: Sequence[Problem], cfg, ctx: int,
                log=print) -> tuple[list[Problem], list[list[int]]]:
    """Token ids of every prompt; prompts too long for the context are dropped and counted (not
    fatal)."""
    keep, ids = [], []
    for p in problems:
        t = tok.encode(format_prompt(tok, p, cfg.chat_template, cfg.chat_thinking),
                       add_special_tokens=False)
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
