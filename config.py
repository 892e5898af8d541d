"""
config.py: every setting of a run, in one place.

    python train.py                                  # configs/tiny.py, the embedded default
    python train.py configs/gsm8k_qwen3.py --lr=2e-6 # a config file, then command-line overrides
    python train.py configs/lagged.py --help         # every key by stage: its value, what it does

`Config` holds every key with its default (defaults for a real model on one GPU). A config file is
Python: a short list of commented assignments of Config's fields; `configs/tiny.py` applies whenever
no config file is given. Command-line overrides are --key=value or --key value (a bool key alone,
--resume, means true), parsed as Python literals. Unknown keys (with a suggestion) and wrong types
are errors that name the key, as are bad values (checks.py). train.py writes the config a run used
to out_dir/config.json (a resume, to config.resume-<step>.json). `cli` runs an entry point: a
user's error is one line (exit code 2), Ctrl-C one note (exit code 130), and --help the entry
point's text (train.py: report.help_text, which reads each key's description from its comments in
Config).
"""

import ast
import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass, field

# the value checks and the constants they share, re-exported here (checks.py)
from checks import (MARKED_VARS, RG_BINS, RG_KEYS, RG_PREFIX, TASK_CONFIGS,  # noqa: F401
                    TEACHER_TASKS, TRACE_TOKENS, check)


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
    # > 0 (reasoning-gym chain_sum): the held-out set is drawn per difficulty, this many problems of
    # each (n_eval unused), or as many unseen ones as the draws find where fewer exist
    eval_per_bin: int = 0
    # > 0: the sampled pass@k runs on the first this many held-out problems of each difficulty
    eval_k_per_bin: int = 0
    # warm start (the tiny model only)
    sft_steps: int = 600
    sft_batch: int = 16
    sft_lr: float = 1e-3
    # > 0: SFT stops once its loss (the mean of the last SFT_WINDOW steps) is at or below this;
    # sft_steps is then the cap and the schedule's length, and the log says which ended it
    sft_loss: float = 0.0
    # fraction of teacher traces that end with the wrong convention (warmstart.py)
    sft_noise: float = 0.0
    # order "marked": the chance that the teacher, on a step whose running sum crosses 10, adds
    # the carry into the units digit ((s + v + 1) % 10) and carries on from its own wrong total: a
    # slip that comes with the input, more often the longer the chain (warmstart.py); order
    # "lagged": the chance of its rarer slip (tasks.lagged_trace); string_splitting: the chance
    # that it drops the carry of Z from 9 to 10 (warmstart.string_splitting_trace)
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
    decode_step: str = "auto"  # auto | eager | fused (CPU, C++ layers) | compile | graph (CUDA)
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
    spec_draft: str = "sparse"  # drafts: sparse (the sparse-KV policy) | suffix (group text) | mix
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
    # a prompt's prior pass rate: Beta(1, 1) (flat), or its difficulty's pooled rate (difficulty:
    # prompts with no meta["difficulty"] fall back to flat; `python -m bench recipe`'s pooled-prior)
    zone_prior: str = "flat"
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
    # the ratio's clip (clip-higher: clip_high > clip_low). It binds only past a batch's first
    # optimizer step (passes or minibatches > 1): at the first the ratio is 1 at every token
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
