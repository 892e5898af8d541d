"""
checks.py: the checks of a config's values, at parse time (config.parse_config calls `check`), each
error naming its key: a typo costs a second, not a warm start. The constants they share with the
rest of the code (RG_PREFIX, TEACHER_TASKS, TRACE_TOKENS, TASK_CONFIGS, MARKED_VARS) live here too;
config.py re-exports them. No import of the project: config.py sits above this file.

    check(cfg)          # ValueError naming the key, or nothing
    check_task(cfg)     # a reasoning-gym task's name and settings against the library's own
"""

import dataclasses
import difflib
import importlib.util
import os
import re

MARKED_VARS = 14  # the synthetic task's order "marked": the items every prompt lists (tasks.py)

CHOICES = {"device": ("auto", "cpu", "cuda"), "dtype": ("float32", "bfloat16"),
           "autocast": ("none", "bfloat16"), "decode_step": ("auto", "eager", "compile", "graph"),
           "order": ("defined", "shuffled", "marked", "lagged"),
           "kv_scorer": ("centroid", "quest", "oracle"), "kv_hold": ("position", "rollout"),
           "kv_dtype": ("auto", "float32", "bfloat16"), "rollout_mode": ("sparse", "speculative"),
           "sampler": ("growth", "uniform"), "zone_prior": ("difficulty", "flat"),
           "is_correction": ("none", "tis", "mis"),
           "pack": ("auto", "on", "off"), "kl_loss": ("k2", "k3"), "adv_norm": ("std", "none"),
           "max_staleness": (0, 1), "router_replay": ("off", "logprob", "update"),
           "rg_prompt": ("question", "expression", "last_paragraph", "aligned"),
           "tracker": ("none", "trackio", "wandb"), "spec_draft": ("sparse", "suffix", "mix")}
POSITIVE = ("lr", "sft_lr", "sft_steps", "sft_batch", "n_eval", "n_layer", "n_embd", "n_head",
            "n_kv_head", "ffn", "moe_ffn", "prompts_per_step", "max_new_tokens", "page_size",
            "kv_bin_pages", "kv_rescore_every", "spec_k", "save_every", "max_skipped", "logp_chunk",
            "calib_prompts", "distill_lr", "judge_timeout_s", "alpha_topk", "grad_clip", "passes",
            "minibatches", "micro_batch", "lora_alpha", "is_cap", "adv_eps", "eval_every")
NON_NEGATIVE = ("seed", "stop_at", "threads", "n_train", "dense_layers", "kv_compare_every",
                "kv_keep_first", "kv_keep_recent", "spec_k_max", "kv_pool_tokens",
                "distill_r", "distill_coef", "refill_tries", "min_spread", "max_chars",
                "overlong_buffer", "overlong_penalty", "steps", "warmup_steps", "weight_decay",
                "clip_high", "kl_coef", "lora_r", "rollout_ranks", "sft_noise", "n_expert",
                "moe_aux_coef", "sft_max_lines", "eval_k", "eval_per_bin", "eval_k_per_bin",
                "sft_loss")
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
    if cfg.sft_slip and cfg.order not in ("marked", "lagged") and not cfg.task.endswith(
            ":string_splitting"):
        raise bad("sft_slip", "0 unless order is 'marked' or 'lagged' or the task string_splitting")
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
    if cfg.rollout_mode == "speculative" and kind == "dense" and cfg.spec_draft != "suffix":
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
# a task's own settings (a --task that differs from the config file's drops the file's)
RG_KEYS = ("rg_kwargs", "sft_rg_kwargs", "eval_rg_kwargs", "rg_prompt", "eval_per_bin")
# reasoning-gym tasks whose traces the tiny model's teacher writes (warmstart.teacher_trace)
TEACHER_TASKS = ("chain_sum", "string_splitting")
# ... their traces' tokens (a character each), at least, from an item's metadata; a config for each
TRACE_TOKENS = {"chain_sum": lambda m: 4 * m["num_terms"] + 7,
                "string_splitting": lambda m: 20 * len(m["states"]) + 16}
TASK_CONFIGS = {"chain_sum": "configs/tiny.py", "string_splitting": "configs/splitting.py"}
# the generator settings that pin one difficulty (eval_per_bin: tasks.per_bin_problems)
RG_BINS = {"chain_sum": ("min_terms", "max_terms")}


def check_task(cfg, typed=()):
    """task and its reasoning-gym settings. A reasoning_gym task names one of the library's
    generators; rg_kwargs, and rg_kwargs merged with sft_rg_kwargs or eval_rg_kwargs, may set only
    the fields of that generator's config (its own validate() then checks their values): a
    misspelt name or setting is refused here, with the names it could be. So is a max_new_tokens
    from a config file (not `typed` on the command line) that would cut most of the tiny model's
    teacher traces: `--task=` on a config made for another task keeps the file's length."""
    rg_keys = RG_KEYS[:3]
    if cfg.eval_per_bin and cfg.task[len(RG_PREFIX):] not in RG_BINS:
        raise ValueError(f"config key 'eval_per_bin' draws a held-out set per difficulty for "
                         f"{', '.join(RG_PREFIX + k for k in RG_BINS)} only, not {cfg.task}")
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
