# python train.py configs/splitting.py
# The second long-CoT family of `python -m bench sparrow --config configs/splitting.py`: reasoning-gym's
# string_splitting (machines A, B, C dismantled and combined into parts X, Y, Z by five rules, applied
# until none applies). The teacher is exact (warmstart.string_splitting_trace): one line a state, "1 26 28
# 16 02 01 00", 55 to 110 lines, about 900 to 1,800 generated tokens. Unlike configs/lagged.py, whose copy
# tokens look 256 back, every line here follows from the one above it: after the first line a token needs
# only the last 20 or so. The same 0.8M-parameter model and sparse settings as configs/lagged.py.
out_dir = "out/splitting"
task = "reasoning_gym:string_splitting"
rg_kwargs = {"min_initial_machines": 12, "max_initial_machines": 25}  # RL and held out
sft_rg_kwargs = {"min_initial_machines": 1}  # the warm start: 1 to 25 machines of each kind
rg_prompt = "last_paragraph"  # the counts; the rules, the same in every item, are the warm start's
n_train = 2000
n_eval = 32
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
# warm start in three stages: configs/splitting_base.py (whole traces: the rules, but the prompt's counts
# misread), configs/splitting_copy.py (the first 2 lines: the counts read, the chain forgotten), then 150 steps
# on whole traces of 1 to 25 machines again. The teacher of the whole traces slips at one kind of step: where
# rule 5 takes Z from 09 to 10, half the time it drops the carry (writes 00) and carries on from there
# (warmstart.string_splitting_trace). Every RL problem's Z passes 10, so RL has a slip to remove: from an exact
# teacher, 20 steps of dense RL left held-out accuracy where it was (0.656 -> 0.625), and no sparse arm could be
# judged against dense
sft_init = "configs/splitting_copy.py"
sft_steps = 150
sft_batch = 8
sft_lr = 1e-3
sft_slip = 0.5
prompts_per_step = 4
group_size = 8
max_new_tokens = 2048
# sampled at 0.5: at 1.0 a rollout of 1,300 tokens slips somewhere nearly every time (step 0's rollouts score
# 0.125 with --temperature=1.0 against 0.438 here; greedy, the warm start solves 0.656 of the held-out set: the
# exact teacher's warm start; the slipping one solves 0.281, and 20 dense RL steps take it to 0.54)
temperature = 0.5
lr = 1e-5  # 5e-5 (configs/lagged.py's) took held-out accuracy from 0.66 to 0.19 in 5 steps: at temperature 0.5
          # the log-probs' gradients are twice as large, and most steps keep one group of four
steps = 20
warmup_steps = 2
refill_tries = 0
micro_batch = 8
eval_every = 5
save_every = 5
# stage 2 (the sparse arms of the bench; this config alone decodes densely), as configs/lagged.py
page_size = 64
kv_bin_pages = 8
kv_rescore_every = 4
dense_layers = 1
kv_candidates = (3, 4, 6, 8, 12, 16, 24, 32, 48)
calib_prompts = 4
kv_compare_every = 5
