# python train.py configs/lagged.py
# The long-CoT regime on a CPU: the synthetic task's order "lagged" (tasks.py), whose completions run
# 16 to 48 lines of 65 tokens, about 1,000 to 3,100 generated tokens after a prompt of 260. Each
# token copies one 256 tokens back or adds the two before it, so decode reads a long KV cache for
# a few sharp positions. The same 0.8M-parameter model as configs/sharpen.py.
out_dir = "out/lagged"
task = "synthetic"
order = "lagged"
difficulty = (16, 48)
n_train = 2000
n_eval = 32
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
# warm start: a curriculum. configs/lagged_short.py's SFT on 5-line prefixes (built first if
# needed), then 300 steps on whole traces of 1 to 48 lines, from the same teacher: it slips at one
# pair in 1,000 with chance 0.5 (tasks.lagged_trace), so over 1,000-3,000 generated tokens a
# rollout meets the slip about once and sampling sometimes avoids it
sft_init = "configs/lagged_short.py"
sft_difficulty = (1, 48)
sft_steps = 300
sft_batch = 4
sft_lr = 1e-3
sft_slip = 0.5
prompts_per_step = 4
group_size = 8
max_new_tokens = 3200
lr = 2e-4
steps = 20
warmup_steps = 2
refill_tries = 0
micro_batch = 8
eval_every = 5
save_every = 5
