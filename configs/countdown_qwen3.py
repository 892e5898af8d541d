# python train.py configs/countdown_qwen3.py
# One GPU: GRPO from Qwen3-0.6B on reasoning-gym's Countdown, TinyZero's task: reach the
# target with + - * / and each given number at most once. The problems are generated here, offline (about a minute
# for the pool), and the library's own score_answer is the verifier's last stage: an expression that reaches the
# target another way than the reference still scores 1. Only the model needs a network (or a local copy).
# Expected figures: not yet run. A run should record held-out accuracy before and after RL, the reward curve and
# the fraction of completions that reach the library's scorer ("verify" in the log).
# Predicted, not measured (no GPU has run zeros yet): peak memory 62.2 GiB of an H100 80GB's 79.1, in the training
# forward: the KV pool 29.3 GiB (bf16, one rollout batch: 32 x 8 rows of 1,024 tokens), a micro-batch's activations
# 20.1 GiB, AdamW 4.4, weights and gradients 2.2 each; 64.2 GiB with flash-attn installed (packed rows, each with its
# prompt). `python memory.py configs/countdown_qwen3.py` prints the breakdown; train.py prints it at start and
# refuses a config that will not fit. One step, every row to 1,024 tokens, at least 6.7 s on an H100 (5.1 s on an
# H200: decode is memory-bound) by the cost model (bench/gpu.py's step_cost at the datasheets' rates, no overheads;
# one try, before dynamic sampling's refills): a floor, not an estimate of the time a step takes here.
model = "Qwen/Qwen3-0.6B"
task = "reasoning_gym:countdown"
# 3 or 4 numbers from 1 to 100, targets 10 to 100 (TinyZero's range); the generator's default is 4-6 numbers
# and targets 100-999
rg_kwargs = {"min_numbers": 3, "max_numbers": 4, "min_target": 10, "max_target": 100}
n_train = 4000          # about 12 ms a problem to generate
n_eval = 200            # held out: no question of the pool among them
out_dir = "out/countdown_qwen3_0.6b"
autocast = "bfloat16"   # fp32 master weights, bf16 compute
prompts_per_step = 32
group_size = 8
max_new_tokens = 1024
# Qwen3's chat template thinks first unless told not to: a <think> block can outrun 1,024 tokens
# before "#### <expression>", and a cut row scores 0
chat_thinking = False
temperature = 1.0
lr = 1e-6               # full fine-tuning; LoRA wants about 10x more
warmup_steps = 10
steps = 200
micro_batch = 8         # 8 rows, one group: its prompt runs once; 4 would save about 10 GiB
eval_every = 25
save_every = 50
