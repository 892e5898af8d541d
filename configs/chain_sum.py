# python train.py configs/chain_sum.py --threads=2
# reasoning-gym's chain_sum on the tiny model (0.8M parameters, CPU, offline), from an exact teacher: the candidate
# for the embedded default that issue 29 asks for. It does not yet show what the default must: the warm start is
# weak in its own SFT range too (greedy 0.50-0.57 on 3-4 terms), and 60 RL steps leave held-out accuracy where it
# was (0.104 -> 0.106, seed 0; at lr 1e-3 it falls). Measured figures: README, "A reasoning-gym default: not yet".
# SFT sees sums of 2 to 4 terms, RL 2 to 7, held-out evaluation 3 to 10 (every 2-term sum is in the pool).
out_dir = "out/chain_sum"
task = "reasoning_gym:chain_sum"
# one-digit terms (0-9), + or - at random: "7-3+5+9=" -> 18. A sum of 8 to 10 terms spreads over about 90 values:
# always guessing the likeliest passes 2.5-3% of the time, but 64 such guesses pass about half the time, so pass@64
# here says little (two-digit terms: the tiny model's warm start did not learn their arithmetic in 1,600 steps)
rg_kwargs = {"min_digits": 1, "max_digits": 1, "min_terms": 2, "max_terms": 7}   # RL: 2 to 7 terms
sft_rg_kwargs = {"max_terms": 4}    # warm start: 2 to 4 terms only
eval_rg_kwargs = {"max_terms": 10}  # held out: up to 10 terms
rg_prompt = "expression"    # the prompt is the expression and "=" alone, for the character model
n_train = 20000
n_eval = 120                # about 15 per number of terms, disjoint from the pool and the SFT data
eval_sampled = True         # pass@1, pass@8 and pass@64 at temperature 1, before and after RL
eval_k = 64
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
# warm start: exact traces (warmstart.chain_sum_trace): "+07-3=+04+5=+09+9=+18\n#### 18", each total signed
sft_steps = 1600
sft_batch = 16
sft_lr = 2e-3
prompts_per_step = 16
group_size = 8
max_new_tokens = 72         # a 10-term trace is 66 characters
lr = 2e-4
steps = 60
warmup_steps = 5
micro_batch = 64
eval_every = 5              # held-out greedy accuracy every 5 steps: the curve in run.png
save_every = 20
