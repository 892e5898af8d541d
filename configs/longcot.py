# python train.py configs/longcot.py
# The CPU long-CoT default for stage 2's sparse decode: the synthetic task at 16 to 24 terms, so a rollout runs to
# 200-400 cached tokens and decode attention, not the weights, sets the pace.
# The same 0.8M-parameter model as configs/tiny.py; everything not set here is the Config default.
out_dir = "out/longcot"
task = "synthetic"
difficulty = (16, 24)
order = "defined"
n_train = 20000
n_eval = 64
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
sft_steps = 300
sft_batch = 16
sft_lr = 1e-3
sft_noise = 0.6
prompts_per_step = 8
group_size = 8
max_new_tokens = 224
lr = 1e-4
steps = 30
warmup_steps = 3
micro_batch = 16
eval_every = 10
save_every = 10
