"""
config.py: every setting of a run, in one place.

    python train.py                                  # configs/tiny.py, the embedded default
    python train.py configs/gsm8k_qwen3.py --lr=2e-6 # a config file, then command-line overrides
    python train.py configs/lagged.py --help         # every key by stage: its value, what it does

`Config` holds every key with its default (defaults for a real model on one GPU). A config file is
Python: a short list of commented assignments of Config's fields; `configs/tiny.py` applies whenever
no config file is given. Command-line overrides are --key=value or --key value (a bool key alone,
--resume, means true), parsed as Python literals. Unknown keys (with a suggestion) and wrong types
are errors that name the key. train.py writes the config a run used to out_dir/config.json (a
resume, to config.resume-<step>.json). `cli` runs an entry point: a user's error is one line (exit
code 2), Ctrl-C one note (exit code 130), and --help the entry point's text (train.py:
report.help_text, which reads each key's description from its comments in Config).
"""

import ast
import dataclasses
import difflib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field


@dataclass
class Config:
    """Every setting, with defaults for a real model on one GPU. configs/tiny.py overrides them for
    the embedded default, and applies whenever no config file is given."""
    # run
    out_dir: str = "out/run"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16: the policy's weights (and optimizer state)
    # none | bfloat16: compute dtype of rollouts and training forwards on CUDA
    autocast: str = "none"
    resume: bool = False  # continue from out_dir/ckpt
    # resume: keys (e.g. steps,lr) that may differ from the checkpoint's (checkpoint.RESUME_FREE)
    resume_override: str = ""
    # replace the run already in out_dir (its checkpoint, metrics.jsonl and run.png); without it
    # (or resume), a run refuses a folder that holds one
    overwrite: bool = False
    threads: int = 0  # torch CPU threads; 0 = torch's default
    # model: a hub name or a local HF folder; empty = the tiny model below, warm-started by SFT
    model: str = ""
    chat_template: bool = True  # use the tokenizer's chat template when it has one
    # false: the template renders the prompt with thinking off (Qwen3's enable_thinking=False: an
    # empty <think></think> block, so the answer starts at once)
    chat_thinking: bool = True
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int = 2
    ffn: int = 384
    # > 0: the tiny model is a Qwen3-MoE, every layer this many experts of width moe_ffn, top-k
    n_expert: int = 0
    n_expert_active: int = 2  # k of the top-k
    moe_ffn: int = 96
    # data
    # synthetic | gsm8k | math | code (MBPP, rewarded by unit tests in the sandbox) |
    # reasoning_gym:<name>, one of reasoning-gym's generators. The tiny model (no --model) has
    # teacher traces for synthetic, chain_sum and string_splitting only: others need --model
    task: str = "synthetic"
    # reasoning_gym tasks: the generator's settings, its config's fields, e.g. {"min_terms": 2,
    # "max_terms": 4}; checked against the generator's own config when the config is parsed.
    # n_train, n_eval and seed set the sizes and seeds: "size" and "seed" are refused here
    rg_kwargs: dict = field(default_factory=dict)
    # ... and what differs, merged over rg_kwargs, for the warm start's SFT data (e.g.
    # {"max_terms": 4}: RL trains past SFT's range)
    sft_rg_kwargs: dict = field(default_factory=dict)
    # what differs for the held-out set, merged over rg_kwargs (e.g. {"max_terms": 12}: held out
    # reaches past RL's range)
    eval_rg_kwargs: dict = field(default_factory=dict)
    # question: the prompt is the item's question and tasks.RG_INSTRUCTION; expression: its
    # metadata's expression and "=" alone (chain_sum: "47+35-19="), compact for the character model;
    # last_paragraph: the question's last paragraph and the instruction (string_splitting: the
    # counts, where the rules before them are the same in every item); aligned (chain_sum, one
    # digit): each term in a cell of 4 characters, every prompt one length (tasks.aligned_prompt)
    rg_prompt: str = "question"
    # hub name or local .jsonl/.parquet (gsm8k, math); empty = the task's default hub name
    data: str = ""
    difficulty: tuple = (2, 8)  # synthetic task: range of chain lengths
    # synthetic task: defined | shuffled | marked | lagged (see tasks.make_synthetic)
    order: str = "defined"
    # problems in the training pool (0 = every row of a dataset; synthetic needs a number)
    n_train: int = 0
    n_eval: int = 500  # held-out problems
    eval_difficulty: tuple = ()  # synthetic held-out range of chain lengths (empty: difficulty)
    # also the start's and the end's pass@1 .. pass@k, sampled: k = eval_k (0: group_size) samples
    eval_sampled: bool = False  # per problem, pass@1, 8, 64, ... and pass@k from them
    eval_k: int = 0
    # warm start (the tiny model only)
    sft_steps: int = 600
    sft_batch: int = 16
    sft_lr: float = 1e-3
    # fraction of teacher traces that end with the wrong convention (warmstart.py)
    sft_noise: float = 0.0
    # order "marked" only: the chance that the teacher, on a step whose running sum crosses 10,
    # adds the carry into the units digit ((s + v + 1) % 10) and carries on from its own wrong
    # total: a slip that comes with the input, more often the longer the chain (warmstart.py);
    # order "lagged": the chance of its rarer slip (tasks.lagged_trace)
    sft_slip: float = 0.0
    # order "lagged", string_splitting: SFT trains on at most this many lines of a trace (a prefix,
    # with no end); 0 = whole traces. Short prefixes are cheap, but a model trained on them alone
    # fails past them
    sft_max_lines: int = 0
    # synthetic warm start: range of chain lengths for SFT (empty: difficulty)
    sft_difficulty: tuple = ()
    # synthetic warm start: SFT from a checkpoint or a config file's own warm start, not scratch
    sft_init: str = ""
    # the warm start's seed (-1: seed): fix it to vary the RL run's seed over one warm start
    sft_seed: int = -1
    # rollout
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str = ""  # a stop string (besides EOS); empty = none
    page_size: int = 16  # KV-cache page, in tokens
    # the KV cache's dtype: auto | float32 | bfloat16; auto is bfloat16 on CUDA (half of fp32's
    # bytes, and the kernel's tensor-core path) and the rollout model's weight dtype elsewhere
    kv_dtype: str = "auto"
    # the KV pool's capacity in tokens, allocated once and reused by every generate call (rollout,
    # dense comparison, held-out evaluation, which splits its prompts into calls that fit); 0 =
    # one rollout batch: prompts_per_step groups, each group's prompt pages once plus group_size
    # rows of max_new_tokens, at the longest training prompt, in pages (rollout.pool_pages)
    kv_pool_tokens: int = 0
    # KV pages read per decode step: dense | fraction:F | fixed:N | table:N1,N2,... |
    # schedule:PATH (a table written by calibrate.py) | calibrate (calibrate.py's sweep at start)
    kv_budget: str = "dense"
    kv_bin_pages: int = 125  # table: bin width in pages (Sparrow: 2,000 tokens = 125 pages of 16)
    # centroid | quest | oracle (true attention mass: a yardstick, reads every key)
    kv_scorer: str = "centroid"
    # score the pages once in this many decode steps, the steps between reusing those scores
    kv_rescore_every: int = 1
    dense_layers: int = 2  # the first layers always read every page
    # every sparse step reads the first kv_keep_first pages (sinks) and the last kv_keep_recent
    # (the partial page among them): their sum is the floor, and a budget below it is refused
    kv_keep_first: int = 1
    kv_keep_recent: int = 2
    # table budgets: adjust the table online to hold a mismatch figure per bin at its target
    kv_controller: bool = False
    # what calibration and the controller hold: "position", Sparrow's per-position tail (the
    # kv_quantile of alpha per bin >= kv_target), or "rollout", each rollout's summed TV
    # sum_t (1 - alpha_t), its (1 - kv_quantile) tail held <= kv_tv_target (calibrate.tv_bin_stats)
    kv_hold: str = "position"
    kv_target: float = 0.86  # Sparrow's threshold for the 5th percentile of alpha in each bin
    kv_tv_target: float = 0.5  # kv_hold=rollout: expected parting positions, per rollout's tail
    # sparse: sample from the (sparse-KV) rollout engine, lossy, measured and IS-corrected; with
    # kv_budget=dense (the default) it reads every page: plain dense decoding;
    # speculative: the sparse-KV policy drafts spec_k tokens, the dense one verifies: exact samples
    rollout_mode: str = "sparse"
    spec_k: int = 8
    spec_k_max: int = 0  # > 0: each rollout's k chosen in 1..spec_k_max from the last one's figures
    # the quantile of alpha that calibration and the controller hold at kv_target (Sparrow: 0.05);
    # lower sees rarer mismatched positions, which decide an exact chain of thousands of tokens
    kv_quantile: float = 0.05
    # per-position alpha from top-k lists (exact for a vocabulary of <= 256 tokens)
    alpha_topk: int = 20
    # calibration: budgets swept, in pages
    kv_candidates: tuple = (3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    # calibration: training prompts (group_size rollouts each) per candidate
    calib_prompts: int = 16
    # > 0: every this many steps, time a dense rollout of the same prompts (speedup)
    kv_compare_every: int = 0
    # > 0: DistillSparse, a rollout-only LoRA of this rank trained toward the dense policy (in
    # speculative mode it is the draft's: it raises the acceptance, the samples stay exact)
    distill_r: int = 0
    distill_lr: float = 1e-3
    distill_coef: float = 1.0  # lambda of lambda * KL(dense || sparse)
    distill_pg: bool = False  # also train the adapter with the policy loss on the sparse replay
    # stage 1: which prompts (growth zone) and dynamic sampling
    sampler: str = "growth"  # growth | uniform
    zone: tuple = (0.1, 0.9)  # pass-rate bounds of the growth zone
    explore: float = 0.1  # fraction of each batch spent on the least recently seen prompts
    # drop groups whose rewards are all equal and refill (False: train on every group)
    dynamic_sampling: bool = True
    # extra draws (missing groups / keep rate each) to refill dropped groups; then train short
    refill_tries: int = 2
    min_spread: float = 0.0  # a group is kept when max - min reward exceeds this
    # stage 3: the verifier cascade
    # symbolic equivalence (math, gsm8k, synthetic) for answers no cheap rule settles
    math_verify: bool = True
    max_chars: int = 0  # cheap check: longer completions score 0 (0 = no limit)
    judge: str = ""  # optional "module:function" taking (prompt, completion, reference) -> float
    judge_timeout_s: float = 30.0  # a judge call past this scores 0 and is counted as a timeout
    # > 0: DAPO's soft overlong punishment over the last this many tokens of the limit
    overlong_buffer: int = 0
    # the punishment at max_new_tokens (linear from 0 at the buffer's start)
    overlong_penalty: float = 1.0
    # DAPO's overlong filtering: completions cut at max_new_tokens leave the loss
    overlong_filter: bool = False
    # stage 4: the update
    steps: int = 200
    # > 0: stop after this many steps, on the learning-rate schedule of `steps` (a short probe)
    stop_at: int = 0
    lr: float = 1e-6
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    passes: int = 1  # optimizer passes over each batch
    minibatches: int = 1  # optimizer steps per pass
    micro_batch: int = 8  # sequences per forward/backward
    # scored positions per projection onto the vocabulary in the log-prob pass: its largest tensor
    # is (logp_chunk, vocab) fp32 logits, however many positions a micro-batch scores
    logp_chunk: int = 1024
    # the training forwards run a prompt that a group's rows share once (update.PromptOnce; dense
    # models, unpacked, not under FSDP), its keys and values shared by the rows; false: each row
    # runs its prompt
    share_prompt: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    # k2 | k3 (update.pg_loss): k2's gradient is KL(policy || ref)'s, k3's KL(ref || policy)'s
    kl_loss: str = "k2"
    # std | none: divide the group advantage by the group's std (GRPO), or not (Dr. GRPO)
    adv_norm: str = "std"
    # stop the run after this many optimizer steps in a row skipped for NaN/inf
    max_skipped: int = 3
    # "N:M" (e.g. "2:4"): the policy is pruned N:M at the start (magnitude) and trains under that
    # fixed mask: only the active weights change, and a delta sync ships only what changed
    nm: str = ""
    # > 0: train a LoRA adapter of this rank on every linear layer instead of all weights
    lora_r: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    # same | bf16 | fp8 | nm2:4 (any nN:M) | a plan file *.json (examples/hirelc.py): the weights
    # that generate rollouts
    rollout_copy: str = "same"
    # an N:M copy's masks: magnitude | wanda (calibrated on the task's prompts) | a roi.py mask file
    rollout_copy_mask: str = "magnitude"
    # none | tis | mis: importance weights for the rollout/trainer mismatch
    is_correction: str = "tis"
    # MoE router replay (R3): off | logprob (logp_old's pass routes through the rollout's experts)
    # | update (the training forwards too). Gate weights come from the current router
    router_replay: str = "off"
    moe_aux_coef: float = 0.0  # MoE: weight of the load-balancing loss (Qwen3-MoE uses 0.001)
    is_cap: float = 2.0  # tis: weight = min(p_train / p_rollout, is_cap)
    mis_low: float = 0.5  # mis: tokens whose ratio leaves [mis_low, mis_high] are dropped
    mis_high: float = 2.0
    adv_eps: float = 1e-6
    # auto | on | off: pack sequences without padding. auto: where flash-attn's varlen kernel runs
    # (CUDA, bf16 by autocast or dtype); on elsewhere: SDPA with one dense (total x total) mask
    pack: str = "auto"
    # evaluation, checkpoints, logs
    eval_every: int = 25
    save_every: int = 25
    plot: bool = True
    # an experiment tracker beside metrics.jsonl (report.Tracker), its package optional:
    # none | trackio (local, offline) | wandb (offline unless WANDB_MODE says otherwise)
    tracker: str = "none"
    # shard weights, gradients and optimizer state (FSDP2 fully_shard); rollouts use a full replica
    fsdp: bool = False
    # disaggregated mode under torchrun: the last `rollout_ranks` ranks only generate, the others
    # only train
    rollout_ranks: int = 0
    # 0: rollouts wait for the newest weights; 1: they may be one version behind (TIS)
    max_staleness: int = 1


# ----------------------------------------------------------------------------- config parsing


def _typecheck(key, value, default):
    want = type(default)
    if isinstance(value, str) and want is not str:  # from the command line
        if want is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config key '{key}' wants a bool (true/false), got {value!r}")
            return value.lower() in ("true", "1")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"config key '{key}' wants {want.__name__}, got {value!r}") from None
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is tuple and isinstance(value, list):
        value = tuple(value)
    if want is tuple and isinstance(value, int):
        value = (value, value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ValueError(f"config key '{key}' wants {want.__name__}, "
                         f"got {value!r} ({type(value).__name__})")
    return value


TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.py")


def split_args(argv):
    """argv -> (config files, {key: value as typed}). A key is --key=value or --key value; a bool
    key alone (--resume) means true. Files apply first, in order, then the keys."""
    keys, files, cli, i = dataclasses.asdict(Config()), [], {}, 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        k, eq, v = arg[2:].partition("=")
        flag = isinstance(keys.get(k), bool)
        if not arg.startswith("-"):
            files.append(arg)
        elif not arg.startswith("--"):
            raise ValueError(f"argument {arg!r}: a key takes two dashes, --key=value or "
                             f"--key value")
        elif eq:
            cli[k] = v
        elif i < len(argv) and not argv[i].startswith("--") and (
                not flag or argv[i].lower() in ("true", "false", "1", "0")):
            cli[k], i = argv[i], i + 1  # --key value (an unknown key: parse_config names it)
        elif flag or k not in keys:
            cli[k] = "true"  # a bool key alone: --resume
        else:
            raise ValueError(f"config key '{k}' has no value: give --{k}=VALUE or --{k} VALUE")
    return files, cli


def parse_config(argv):
    """argv: [config_file.py] [--key=value | --key value | --flag ...] -> Config. Without a config
    file, configs/tiny.py applies. A --task that differs from the file's drops the file's
    reasoning-gym keys (RG_KEYS): they belong to its task (`python train.py --task=gsm8k` on the
    default's chain_sum)."""
    cfg, (paths, cli), files = Config(), split_args(argv), {}
    defaults = dataclasses.asdict(cfg)
    for arg in paths or [TINY]:
        ns = {}
        if not os.path.exists(arg):
            raise FileNotFoundError(f"config file {arg!r} does not exist")
        with open(arg) as f:
            exec(compile(f.read(), arg, "exec"), {}, ns)
        files.update({k: v for k, v in ns.items() if not k.startswith("_")})
    if "task" in cli and cli["task"] != files.get("task"):  # the file's task settings go with it
        files = {k: v for k, v in files.items() if k not in RG_KEYS}
    for k, v in {**files, **cli}.items():
        if k not in defaults:
            near = difflib.get_close_matches(k, defaults, n=1)
            raise ValueError(f"unknown config key '{k}'"
                             + (f" (did you mean '{near[0]}'?)" if near else ""))
        setattr(cfg, k, _typecheck(k, v, defaults[k]))
    check(cfg, typed=cli)
    return cfg


# ---------------------------------------------------------------------- value checks, at parse time

MARKED_VARS = 14  # the synthetic task's order "marked": the items every prompt lists (tasks.py)

CHOICES = {"device": ("auto", "cpu", "cuda"), "dtype": ("float32", "bfloat16"),
           "autocast": ("none", "bfloat16"),
           "order": ("defined", "shuffled", "marked", "lagged"),
           "kv_scorer": ("centroid", "quest", "oracle"), "kv_hold": ("position", "rollout"),
           "kv_dtype": ("auto", "float32", "bfloat16"),
           "rollout_mode": ("sparse", "speculative"),
           "sampler": ("growth", "uniform"), "is_correction": ("none", "tis", "mis"),
           "pack": ("auto", "on", "off"), "kl_loss": ("k2", "k3"), "adv_norm": ("std", "none"),
           "max_staleness": (0, 1), "router_replay": ("off", "logprob", "update"),
           "rg_prompt": ("question", "expression", "last_paragraph", "aligned"),
           "tracker": ("none", "trackio", "wandb")}
POSITIVE = ("lr", "sft_lr", "sft_steps", "sft_batch", "n_eval", "n_layer", "n_embd", "n_head",
            "n_kv_head", "ffn", "moe_ffn", "prompts_per_step", "max_new_tokens", "page_size",
            "kv_bin_pages", "kv_rescore_every", "spec_k",
            "calib_prompts", "distill_lr", "judge_timeout_s", "alpha_topk", "grad_clip", "passes",
            "minibatches", "micro_batch", "lora_alpha", "is_cap", "adv_eps", "eval_every",
            "save_every", "max_skipped", "logp_chunk")
NON_NEGATIVE = ("seed", "stop_at", "threads", "n_train", "dense_layers", "kv_compare_every",
                "kv_keep_first", "kv_keep_recent", "spec_k_max", "kv_pool_tokens",
                "distill_r", "distill_coef", "refill_tries", "min_spread", "max_chars",
                "overlong_buffer", "overlong_penalty", "steps", "warmup_steps", "weight_decay",
                "clip_high", "kl_coef", "lora_r", "rollout_ranks", "sft_noise", "n_expert",
                "moe_aux_coef", "sft_max_lines", "eval_k")
UNIT = ("sft_noise", "sft_slip", "top_p", "kv_target", "explore", "min_lr_ratio", "lora_dropout",
        "clip_low")  # within [0, 1]


def check(cfg, typed=()):
    """Every value that can be checked before the run starts, each error naming its key: a typo
    costs a second, not a warm start."""
    bad = lambda k, want: ValueError(f"config key '{k}' must be {want}, got {getattr(cfg, k)!r}")
    for k, options in CHOICES.items():
        if getattr(cfg, k) not in options:
            raise bad(k, " or ".join(map(str, options)))
    for k in POSITIVE:
        if not getattr(cfg, k) > 0:
            raise bad(k, "> 0")
    for k in NON_NEGATIVE:
        if not getattr(cfg, k) >= 0:
            raise bad(k, ">= 0")
    for k in UNIT:
        if not 0 <= getattr(cfg, k) <= 1:
            raise bad(k, "within [0, 1]")
    for k, lo_min in (("difficulty", 1), ("zone", 0)):
        v = getattr(cfg, k)
        if len(v) != 2 or not lo_min <= v[0] <= v[1] or (k == "zone" and not (v[0] < v[1] <= 1)):
            raise bad(k, "a range (lo, hi) with "
                      + ("1 <= lo <= hi" if k == "difficulty" else "0 <= lo < hi <= 1"))
    for k in ("sft_difficulty", "eval_difficulty"):
        v = getattr(cfg, k)
        if v and (len(v) != 2 or not 1 <= v[0] <= v[1]):
            raise bad(k, "empty or a range (lo, hi) with 1 <= lo <= hi")
    if cfg.sft_slip and cfg.order not in ("marked", "lagged"):
        raise bad("sft_slip", "0 unless order is 'marked' or 'lagged'")
    if cfg.sft_noise and cfg.order == "lagged":  # its traces have no second ending to confuse
        raise bad("sft_noise", "0 for order 'lagged'")
    if not 0 < cfg.kv_quantile < 1:
        raise bad("kv_quantile", "within (0, 1)")
    if cfg.sft_seed < -1:
        raise bad("sft_seed", ">= 0, or -1 for the run's seed")
    if cfg.sft_max_lines and cfg.order != "lagged" and not cfg.task.endswith(":string_splitting"):
        raise bad("sft_max_lines", "0 unless order is 'lagged' or the task string_splitting")
    if cfg.order == "marked":  # a fixed number of items: no chain longer than that
        for k in ("difficulty", "sft_difficulty", "eval_difficulty"):
            if getattr(cfg, k) and getattr(cfg, k)[1] > MARKED_VARS:
                raise bad(k, f"at most {MARKED_VARS} (order 'marked' has {MARKED_VARS} items)")
    if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.n_kv_head:
        raise bad("n_head", f"a divisor of n_embd ({cfg.n_embd}) "
                            f"and a multiple of n_kv_head ({cfg.n_kv_head})")
    if not cfg.temperature > 0:
        raise bad("temperature",
                  "> 0: training rollouts sample (greedy decoding is for held-out evaluation)")
    if cfg.group_size < 2:
        raise bad("group_size",
                  ">= 2 (a group-relative advantage needs two completions per prompt)")
    if cfg.lora_dropout >= 1 or cfg.clip_low >= 1 or cfg.mis_low >= cfg.mis_high:
        raise ValueError("config keys: want lora_dropout < 1, clip_low < 1 and mis_low < mis_high")
    if cfg.overlong_buffer >= cfg.max_new_tokens:
        raise bad("overlong_buffer", f"smaller than max_new_tokens ({cfg.max_new_tokens})")
    check_weights(cfg, bad)
    if cfg.n_expert and not 1 <= cfg.n_expert_active <= cfg.n_expert:
        raise bad("n_expert_active", f"within [1, n_expert={cfg.n_expert}]")
    if cfg.tracker != "none" and importlib.util.find_spec(cfg.tracker) is None:  # not after SFT
        raise ValueError(f"config key 'tracker' is {cfg.tracker!r}, but {cfg.tracker} is not "
                         f"installed: `pip install {cfg.tracker}`, or --tracker=none")
    check_kv_budget(cfg)
    check_processes(cfg)
    check_task(cfg, typed)


def check_weights(cfg, bad):
    """The rollout copy and the N:M mask: what trains and what generates."""
    # nmN:M also needs 0 < N <= M, which the pattern cannot say
    plan = cfg.rollout_copy.endswith(".json")
    if plan and not os.path.isfile(cfg.rollout_copy):
        raise bad("rollout_copy", "an existing plan file when it names a .json")
    if not plan and not re.fullmatch(r"same|bf16|fp8|nm|(nm)?\d+:\d+", cfg.rollout_copy) or (
            ":" in cfg.rollout_copy and not plan
            and not 0 < int(cfg.rollout_copy.split(":")[0].lstrip("nm"))
            <= int(cfg.rollout_copy.split(":")[1])):
        raise bad("rollout_copy", "same, bf16, fp8, nmN:M with 0 < N <= M, or a plan file *.json")
    if cfg.rollout_copy_mask not in ("magnitude", "wanda") and (
            not os.path.exists(cfg.rollout_copy_mask)
            or not (plan or cfg.rollout_copy.startswith("nm") or ":" in cfg.rollout_copy)):
        raise bad("rollout_copy_mask", "magnitude, wanda or an existing mask file (roi.py's "
                                       "masks.pt or its folder), with an N:M rollout_copy")
    if cfg.nm and (not re.fullmatch(r"\d+:\d+", cfg.nm)
                   or not 0 < int(cfg.nm.split(":")[0]) <= int(cfg.nm.split(":")[1])):
        raise bad("nm", "empty or N:M with 0 < N <= M, e.g. 2:4")
    if cfg.nm and (cfg.lora_r or cfg.fsdp):
        raise bad("nm", "empty with lora_r or fsdp (an adapter's update is dense; masks are not "
                        "sharded)")


def check_kv_budget(cfg):
    kind, _, arg = cfg.kv_budget.partition(":")
    ok = {"dense": lambda a: not a, "calibrate": lambda a: not a, "schedule": lambda a: bool(a),
          "fraction": lambda a: 0 < float(a) <= 1, "fixed": lambda a: int(a) >= 1,
          "table": lambda a: all(int(x) >= 1 for x in a.split(","))}
    try:
        good = kind in ok and ok[kind](arg)
    except ValueError:  # float("x") or int("x") on a malformed argument
        good = False
    if not good:
        raise ValueError(f"config key 'kv_budget' must be dense, fraction:F (0 < F <= 1), "
                         f"fixed:N, table:N1,N2,..., schedule:PATH or calibrate, "
                         f"got {cfg.kv_budget!r}")
    floor = cfg.kv_keep_first + cfg.kv_keep_recent  # pages every sparse step reads anyway
    if not cfg.kv_candidates or min(cfg.kv_candidates) < max(1, floor):
        raise ValueError(f"config key 'kv_candidates' must be page counts >= {max(1, floor)}: "
                         f"every step reads the kv_keep_first + kv_keep_recent = {floor} kept "
                         f"pages, so a smaller candidate would read the same as {floor}")
    if not cfg.kv_tv_target > 0:
        raise ValueError("config key 'kv_tv_target' must be > 0")
    small = [(i, int(x)) for i, x in enumerate(arg.split(","))
             if int(x) < floor] if kind in ("table", "fixed") else []
    if small:
        raise ValueError(f"config key 'kv_budget': {cfg.kv_budget} has entries (bin, pages) "
                         f"{small} below the {floor} pages every sparse step reads (kv_keep_first "
                         f"{cfg.kv_keep_first} + kv_keep_recent {cfg.kv_keep_recent}, the partial "
                         f"page among them), so they would read {floor}: raise them, or lower "
                         f"kv_keep_recent")
    if cfg.rollout_mode == "speculative" and kind == "dense":
        raise ValueError("config key 'rollout_mode': speculative needs a sparse kv_budget for the "
                         "draft (dense drafts would all be accepted, at twice the cost)")
    if cfg.spec_k_max and cfg.rollout_mode != "speculative":
        raise ValueError("config key 'spec_k_max' chooses speculative decoding's k: it needs "
                         "rollout_mode = speculative")
    if cfg.kv_controller and kind not in ("table", "schedule", "calibrate"):
        raise ValueError("config key 'kv_controller' needs a table budget "
                         "(kv_budget=table:N1,N2,..., schedule:PATH or calibrate)")
    if cfg.distill_r:
        need = [why for why, miss in (("a sparse kv_budget", kind == "dense"),
                                      ("lora_r = 0", cfg.lora_r),
                                      ("rollout_copy = same", cfg.rollout_copy != "same"),
                                      ("one process", int(os.environ.get("WORLD_SIZE", 1)) > 1))
                if miss]
        if need:
            raise ValueError(f"config key 'distill_r' needs {', '.join(need)}")


RG_PREFIX = "reasoning_gym:"
RG_KEYS = ("rg_kwargs", "sft_rg_kwargs", "eval_rg_kwargs", "rg_prompt")  # a task's own settings
# reasoning-gym tasks whose traces the tiny model's teacher writes (warmstart.teacher_trace)
TEACHER_TASKS = ("chain_sum", "string_splitting")
# ... their traces' tokens (a character each), at least, from an item's metadata; a config for each
TRACE_TOKENS = {"chain_sum": lambda m: 4 * m["num_terms"] + 7,
                "string_splitting": lambda m: 20 * len(m["states"]) + 16}
TASK_CONFIGS = {"chain_sum": "configs/tiny.py", "string_splitting": "configs/splitting.py"}


def check_task(cfg, typed=()):
    """task and its reasoning-gym settings. A reasoning_gym task names one of the library's
    generators; rg_kwargs, and rg_kwargs merged with sft_rg_kwargs or eval_rg_kwargs, may set only
    the fields of that generator's config (its own validate() then checks their values): a
    misspelt name or setting is refused here, with the names it could be. So is a max_new_tokens
    from a config file (not `typed` on the command line) that would cut most of the tiny model's
    teacher traces: `--task=` on a config made for another task keeps the file's length."""
    rg_keys = RG_KEYS[:3]
    if not cfg.task.startswith(RG_PREFIX):
        if cfg.task not in ("synthetic", "gsm8k", "math", "code"):
            raise ValueError(f"config key 'task' must be synthetic, gsm8k, math, code or "
                             f"{RG_PREFIX}<name>, got {cfg.task!r}")
        for k, want in [(k, "empty") for k in rg_keys] + [("rg_prompt", "question")]:
            if getattr(cfg, k) not in ({}, "question"):
                raise ValueError(f"config key '{k}' must be {want} unless task is "
                                 f"{RG_PREFIX}<name>, got {getattr(cfg, k)!r}")
        return
    try:  # lazy: 1.5 s to import, and only these tasks need it
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(f"config key 'task' ({cfg.task}) needs reasoning-gym "
                         f"(pip install reasoning-gym)") from None
    name = cfg.task[len(RG_PREFIX):]
    if name not in DATASETS:
        near = difflib.get_close_matches(name, DATASETS, n=3)
        raise ValueError(f"config key 'task': reasoning-gym has no dataset {name!r}"
                         + (f" (did you mean {', '.join(near)}?)" if near else ""))
    for k in rg_keys:
        check_rg_kwargs(k, name, DATASETS[name][1],
                        {**cfg.rg_kwargs, **getattr(cfg, k)} if k != "rg_kwargs" else cfg.rg_kwargs)
    if cfg.rg_prompt != "question":
        check_rg_prompt(cfg.rg_prompt, name, DATASETS[name][0](DATASETS[name][1](
            **cfg.rg_kwargs, size=1, seed=0))[0])
    wide = [k for k in rg_keys if {**cfg.rg_kwargs, **getattr(cfg, k)}.get("max_digits", 4) > 1]
    if cfg.rg_prompt == "aligned" and wide:  # tasks.aligned_prompt: a cell holds one digit
        raise ValueError(f"config key 'rg_prompt': aligned lays out one-digit terms; set "
                         f"max_digits to 1 in {wide[0]}")
    if not cfg.model and name not in TEACHER_TASKS:  # warmstart.teacher_trace writes no others
        raise ValueError(f"config key 'task' ({cfg.task}) needs model=<a hub name or folder>: "
                         f"the tiny model's warm start has teacher traces only for "
                         f"{', '.join(TEACHER_TASKS)} and the synthetic task")
    if cfg.model or "max_new_tokens" in typed:  # a model's own traces; a length chosen here
        return
    items = DATASETS[name][0](DATASETS[name][1](**cfg.rg_kwargs, size=16, seed=cfg.seed))
    need = sorted(TRACE_TOKENS[name](it["metadata"]) for it in items)
    if need[len(need) // 2] > cfg.max_new_tokens:  # a rollout cut there scores 0: most would be
        raise ValueError(f"config key 'max_new_tokens' ({cfg.max_new_tokens}) is shorter than "
                         f"most {name} teacher traces ({need[0]} to {need[-1]} tokens in 16 "
                         f"items): raise it (--max_new_tokens={1 << need[-1].bit_length()}), or "
                         f"start from {TASK_CONFIGS[name]}, whose settings fit the task")


def check_rg_prompt(prompt, name, item):
    """rg_prompt against one of the generator's items: "expression" needs its metadata's expression
    to be its question (chain_sum's; countdown's is its answer), as does "aligned", "last_paragraph"
    a question of more than one paragraph."""
    if prompt in ("expression", "aligned"):
        expr = item.get("metadata", {}).get("expression")
        if not isinstance(expr, str) or expr not in item["question"]:
            raise ValueError(f"config key 'rg_prompt': {name}'s questions are not their metadata's "
                             f"'expression' (chain_sum's are); use question")
    if prompt == "last_paragraph" and item["question"].strip().count("\n\n") < 1:
        raise ValueError(f"config key 'rg_prompt': {name}'s questions have one paragraph; use "
                         f"question")


def check_rg_kwargs(key, name, config_cls, kwargs):
    """One set of a generator's settings: known fields, not size or seed, and values its own
    config accepts."""
    settings = sorted(f.name for f in dataclasses.fields(config_cls)
                      if f.name not in ("size", "seed"))
    ours = [k for k in kwargs if k in ("size", "seed")]
    if ours:
        raise ValueError(f"config key '{key}' may not set {' or '.join(ours)}: n_train, "
                         f"n_eval and seed set the sizes and seeds of {name}")
    unknown = [k for k in kwargs if k not in settings]
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), settings, n=1)
        raise ValueError(f"config key '{key}': {name} has no setting "
                         f"{', '.join(map(repr, unknown))}"
                         + (f" (did you mean {near[0]!r}?)" if near else "")
                         + f"; its settings: {', '.join(settings)}")
    try:  # the generator's own checks of the values (min <= max, ...), before any generation
        made = config_cls(**kwargs)
        if hasattr(made, "validate"):
            made.validate()
    except Exception as e:
        raise ValueError(f"config key '{key}': {name} refuses {kwargs!r}: "
                         f"{type(e).__name__}: {e}") from None


def check_processes(cfg):
    """FSDP and the disaggregated mode: what they need of torchrun, and what they do not support
    yet."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.fsdp and (cfg.lora_r or cfg.resume or cfg.rollout_ranks or world < 2):
        raise ValueError("config key 'fsdp' needs torchrun with at least 2 processes, and does not "
                         "combine with lora_r, resume or rollout_ranks yet")
    if cfg.rollout_ranks and not cfg.rollout_ranks < world:
        raise ValueError(f"config key 'rollout_ranks' must leave at least one trainer: "
                         f"{cfg.rollout_ranks} of {world} ranks "
                         "(run under torchrun with more processes)")
    if cfg.rollout_ranks and (cfg.resume or cfg.lora_r or cfg.kv_controller):
        raise ValueError("config key 'rollout_ranks': the disaggregated mode does not support "
                         "resume, lora_r or kv_controller yet")


def last_step(cfg):
    """The index of the run's last step: `steps` ends the schedule, `stop_at` may come first."""
    return min(cfg.steps, cfg.stop_at or cfg.steps) - 1


def cli(main, argv, helper=None):
    """Run an entry point's main(argv): the errors a user can fix (a config key, a data file, a run
    that diverged, an out_dir that holds a run) print as one line, with exit code 2, instead of a
    traceback; Ctrl-C prints what main attached to it (train.py: the step, the last checkpoint,
    the command that resumes), with exit code 130. With `helper` (argv without the flag -> a text),
    --help or -h prints its text and exits 0."""
    try:
        if helper is not None and ("--help" in argv or "-h" in argv):
            print(helper([a for a in argv if a not in ("--help", "-h")]))
            return 0
        main(argv)
    except (ValueError, FileNotFoundError, FileExistsError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"\ninterrupted{': ' if e.args else ''}{' '.join(map(str, e.args))}",
              file=sys.stderr)
        return 130
    return 0
