"""
config.py: every setting of a run, in one place.

    python train.py                                  # configs/tiny.py, the embedded default
    python train.py configs/gsm8k_qwen3.py --lr=2e-6 # a config file, then command-line overrides

`Config` holds every key with its default (defaults for a real model on one GPU). A config file is Python: a
short list of commented assignments of Config's fields; `configs/tiny.py` applies whenever no config file is
given. Command-line overrides are --key=value, parsed as Python literals. Unknown keys (with a suggestion) and
wrong types are errors that name the key. train.py writes the config a run used to out_dir/config.json.
"""

import ast
import dataclasses
import difflib
import os
from dataclasses import dataclass


@dataclass
class Config:
    """Every setting, with defaults for a real model on one GPU. configs/tiny.py overrides them for the embedded
    default, and applies whenever no config file is given."""
    # run
    out_dir: str = "out/run"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16: the policy's weights (and optimizer state)
    autocast: str = "none"  # none | bfloat16: compute dtype of rollouts and training forwards on CUDA
    resume: bool = False  # continue from out_dir/ckpt
    threads: int = 0  # torch CPU threads; 0 = torch's default
    # model: a hub name or a local HF folder; empty = the tiny model below, warm-started by SFT
    model: str = ""
    chat_template: bool = True  # use the tokenizer's chat template when it has one
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int = 2
    ffn: int = 384
    # data
    task: str = "synthetic"  # synthetic | gsm8k | math | code (MBPP, rewarded by unit tests in the sandbox)
    data: str = ""  # hub name or local .jsonl/.parquet (gsm8k, math); empty = the task's default hub name
    difficulty: tuple = (2, 8)  # synthetic task: range of chain lengths
    order: str = "defined"  # synthetic task: defined | shuffled (see tasks.make_synthetic)
    n_train: int = 0  # problems in the training pool (0 = every row of a dataset; synthetic needs a number)
    n_eval: int = 500  # held-out problems
    # warm start (the tiny model only)
    sft_steps: int = 600
    sft_batch: int = 16
    sft_lr: float = 1e-3
    sft_noise: float = 0.0  # fraction of teacher traces that end with the wrong convention (warmstart.py)
    sft_difficulty: tuple = ()  # synthetic warm start: range of chain lengths for SFT (empty: difficulty)
    sft_init: str = ""  # synthetic warm start: SFT from a checkpoint, or from a config file's own warm start, not scratch
    # rollout
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str = ""  # a stop string (besides EOS); empty = none
    page_size: int = 16  # KV-cache page, in tokens
    kv_budget: str = "dense"  # dense | fraction:F | fixed:N | table:N1,N2,... | schedule:PATH | calibrate: KV pages
    # read per decode step (schedule: a table written by calibrate.py; calibrate: calibrate.py's sweep at start)
    kv_bin_pages: int = 125  # table: bin width in pages (Sparrow: 2,000 tokens = 125 pages of 16)
    kv_scorer: str = "centroid"  # centroid | quest | oracle (true attention mass: a yardstick, reads every key)
    dense_layers: int = 2  # the first layers always read every page
    kv_controller: bool = False  # table budgets: adjust the table online to hold p5 alpha per bin at kv_target
    kv_target: float = 0.86  # Sparrow's threshold for the 5th percentile of alpha in each bin
    kv_candidates: tuple = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # calibration: budgets swept, in pages
    calib_prompts: int = 16  # calibration: training prompts (group_size rollouts each) per candidate
    kv_compare_every: int = 0  # > 0: every this many steps, time a dense rollout of the same prompts (speedup)
    distill_r: int = 0  # > 0: DistillSparse, a rollout-only LoRA of this rank trained toward the dense policy
    distill_lr: float = 1e-3
    distill_coef: float = 1.0  # lambda of lambda * KL(dense || sparse)
    distill_pg: bool = False  # also train the adapter with the policy loss on the sparse replay
    # stage 1: which prompts (growth zone) and dynamic sampling
    sampler: str = "growth"  # growth | uniform
    zone: tuple = (0.1, 0.9)  # pass-rate bounds of the growth zone
    explore: float = 0.1  # fraction of each batch spent on the least recently seen prompts
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal and refill (False: train on every group)
    refill_tries: int = 2  # extra draws (missing groups / keep rate each) to refill dropped groups; then train short
    min_spread: float = 0.0  # a group is kept when max - min reward exceeds this
    # stage 3: the verifier cascade
    math_verify: bool = True  # symbolic equivalence (math, gsm8k, synthetic) for answers no cheap rule settles
    max_chars: int = 0  # cheap check: longer completions score 0 (0 = no limit)
    judge: str = ""  # optional "module:function" taking (prompt, completion, reference) -> float
    # stage 4: the update
    steps: int = 200
    lr: float = 1e-6
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    passes: int = 1  # optimizer passes over each batch
    minibatches: int = 1  # optimizer steps per pass
    micro_batch: int = 8  # sequences per forward/backward
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    lora_r: int = 0  # > 0: train a LoRA adapter of this rank on every linear layer instead of all weights
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    rollout_copy: str = "same"  # same | bf16 | fp8 | nm2:4 (any nN:M): the weights that generate rollouts
    is_correction: str = "tis"  # none | tis | mis: importance weights for the rollout/trainer mismatch
    is_cap: float = 2.0  # tis: weight = min(p_train / p_rollout, is_cap)
    mis_low: float = 0.5  # mis: tokens whose ratio leaves [mis_low, mis_high] are dropped
    mis_high: float = 2.0
    adv_eps: float = 1e-6
    pack: str = "auto"  # auto | on | off: pack sequences without padding (flash-attn on CUDA; masked SDPA elsewhere)
    # evaluation, checkpoints, logs
    eval_every: int = 25
    save_every: int = 25
    plot: bool = True
    fsdp: bool = False  # shard weights, gradients and optimizer state (FSDP2 fully_shard); rollouts use a full replica
    # disaggregated mode under torchrun: the last `rollout_ranks` ranks only generate, the others only train
    rollout_ranks: int = 0
    max_staleness: int = 1  # 0: rollouts wait for the newest weights; 1: they may be one version behind (TIS)


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
        raise ValueError(f"config key '{key}' wants {want.__name__}, got {value!r} ({type(value).__name__})")
    return value


TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.py")


def parse_config(argv):
    """argv: [config_file.py] [--key=value ...] -> Config. Without a config file, configs/tiny.py applies."""
    cfg = Config()
    defaults = dataclasses.asdict(cfg)
    overrides = {}
    if not any(not a.startswith("--") for a in argv):
        argv = [TINY] + list(argv)
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ValueError(f"argument {arg!r} must look like --key=value")
            k, v = arg[2:].split("=", 1)
            overrides[k] = v
        else:
            ns = {}
            if not os.path.exists(arg):
                raise FileNotFoundError(f"config file {arg!r} does not exist")
            with open(arg) as f:
                exec(compile(f.read(), arg, "exec"), {}, ns)
            overrides.update({k: v for k, v in ns.items() if not k.startswith("_")})
    for k, v in overrides.items():
        if k not in defaults:
            near = difflib.get_close_matches(k, defaults, n=1)
            raise ValueError(f"unknown config key '{k}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
        setattr(cfg, k, _typecheck(k, v, defaults[k]))
    return cfg
