# python train.py configs/marked.py
# The earlier embedded default, kept as a bench workload: a 0.8M-parameter Qwen3-shaped model on the synthetic task
# "marked". SFT sees chains of 2 to 6 from a teacher that slips at carries; RL trains on 2 to 10; held-out evaluation
# runs 2 to 12. Its gain past the SFT range comes from the slip planted in the teacher: RL removes an error the warm
# start can already sample around (its pass@8 matches what the slipping teacher predicts).
out_dir = "out/marked"
task = "synthetic"
# data: order "marked" (tasks.py): every prompt lists the same 14 items "k=v,", the chain is the first d of them
# and its last item ends with "." ("a=3,b=5,c=1.d=4,...?"); the trace restates each value, the running sum and
# the item's separator ("3>3,5>8,1>9.#9"), so every step reads at one distance and the chain ends on content
order = "marked"
sft_difficulty = (2, 6)     # warm start: short chains only
difficulty = (2, 10)        # RL: chains of 2 to 10
eval_difficulty = (2, 12)   # held out: 11 and 12 are seen neither by SFT nor by RL
n_train = 20000
n_eval = 440                # 40 per difficulty, greedy, disjoint from the pool and the SFT data
eval_sampled = True         # also the warm start's pass@1 and pass@8 at temperature 1, per difficulty
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
# warm start: exact traces except a slip at carries (warmstart.teacher_trace): where the running sum crosses 10,
# half the time the teacher adds the carry into the units digit and carries on from its wrong total, a forgotten
# wrap that comes with the input, so errors compound with the chain's length. Without the slip, SFT on 2-6
# already solves 7-12 on most seeds in this format, and RL has little to add.
sft_steps = 1600
sft_batch = 16
sft_lr = 2e-3
sft_noise = 0.0
sft_slip = 0.5
prompts_per_step = 16
group_size = 8
max_new_tokens = 64         # a 12-chain trace is 50 characters
lr = 2e-4
steps = 80
warmup_steps = 5
micro_batch = 64
eval_every = 5              # held-out accuracy every 5 steps: the curve in run.png
save_every = 20
