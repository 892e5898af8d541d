# python train.py configs/sharpen.py
# The earlier embedded default, kept as the fixed workload of the speed benches (step, syncbytes, signal) and as
# the warm start of configs/longcot.py: RL here sharpens, it does not extend. The teacher ends 60% of its traces
# on the wrong convention, so the warm start's pass@8 is already 0.83-0.97 per difficulty while its greedy
# accuracy is 0.11-0.33; RL turns pass@8 into pass@1. A 0.8M-parameter Qwen3-shaped model, CPU, no network.
out_dir = "out/sharpen"
# data: running sums mod 10 over 2 to 8 variables, summed in the order they are defined (tasks.make_synthetic)
task = "synthetic"
difficulty = (2, 8)
order = "defined"
n_train = 20000
n_eval = 200            # held-out problems, greedy, disjoint from the pool and the SFT data
eval_sampled = True     # also the warm start's pass@1 and pass@8 at temperature 1, per difficulty
# the model, built from scratch (model = "" means this tiny one)
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
# warm start: SFT on teacher traces; 60% of them end on the last value instead of the sum (warmstart.teacher_trace),
# so the warm start usually answers with the wrong convention and RL has to find the right one from rewards
sft_steps = 600
sft_batch = 16
sft_lr = 1e-3
sft_noise = 0.6
# RL
prompts_per_step = 16
group_size = 8
max_new_tokens = 64
lr = 1e-4
steps = 60
warmup_steps = 5
micro_batch = 64
eval_every = 20
save_every = 20
