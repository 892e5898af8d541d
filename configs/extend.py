# python train.py configs/extend.py
# A candidate for a default where RL extends the policy past its supervised range (not the default yet: the
# equal-rollout baselines of `python -m bench demo` have not run on it, and a slip above 0.5 makes the slip the
# teacher's majority at each carry, close in kind to a planted convention; see the notes below).
# Measured (`time python train.py configs/extend.py --threads=1 --seed=S`, seeds 0-2, 2-core AMD EPYC VM, 5 min 13 s
# to 5 min 26 s a run): held-out 0.07-0.11 -> 0.99-1.000. Past the SFT range (7-12) the warm start's greedy accuracy
# is 0.000-0.005 (its pass@8 0.14-0.51) and after 80 RL steps 1.000, 0.984 and 1.000 (mean +99 points, seeds within
# 2 points); chains of 2-6 also rise, from 0.17-0.21 to 1.000: RL fixes a slip that compounds with length.
out_dir = "out/extend"
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
# 60% of the time the teacher adds the carry into the units digit and carries on from its wrong total, so errors
# compound with the chain's length. Without the slip, SFT on 2-6 already solves 7-12 on most seeds in this format
# (RL then has little to add); in today's default format it falls to chance past 6.
sft_steps = 1600
sft_batch = 16
sft_lr = 2e-3
sft_noise = 0.0
sft_slip = 0.6
prompts_per_step = 16
group_size = 8
max_new_tokens = 64         # a 12-chain trace is 50 characters
lr = 2e-4
steps = 80
warmup_steps = 5
micro_batch = 64
eval_every = 20
save_every = 20
