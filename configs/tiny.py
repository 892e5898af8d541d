# python train.py            (this file is the default: it applies whenever no config file is given)
# The embedded default: a 0.8M-parameter Qwen3-shaped model on reasoning-gym's chain_sum, on the CPU, with no network,
# from a clean teacher (exact traces, no planted error). SFT sees sums of 2 to 4 terms, RL trains on 2 to 8, held-out
# evaluation runs 2 to 12, so 9 to 12 are seen by neither. The question it answers: does RL make the policy right past
# its supervised range, past what the warm start could already sample (its pass@64 there), and does it beat spending
# the same verifier calls on RFT or more SFT (`python -m bench demo`)?
out_dir = "out/tiny"
task = "reasoning_gym:chain_sum"
# one-digit terms (0-9), + or - at random, the library's generator and its score_answer: "7 - 3 + 5 + 9" -> 18. A sum of
# 9 to 12 terms spreads over about 90 values: always guessing the likeliest answer passes under 3% of the time
rg_kwargs = {"min_digits": 1, "max_digits": 1, "min_terms": 2, "max_terms": 8}   # RL: 2 to 8 terms
sft_rg_kwargs = {"max_terms": 4}     # warm start: 2 to 4 terms only
eval_rg_kwargs = {"max_terms": 12}   # held out: up to 12 terms
# the prompt for the character model (tasks.aligned_prompt): each term signed in a cell of 4 characters, blank cells up
# to 12 terms, then "=": "+7  -3  +5  +9  " + 32 blanks + "=". The trace writes the running total in cells of the same
# size (warmstart.chain_sum_trace): "+007+004+009+018\n#### 18", so step k reads term k at one distance at any length
rg_prompt = "aligned"
n_train = 20000
# the held-out set, drawn number of terms by number of terms, disjoint from the pool and the SFT data: 100 problems of
# each for greedy accuracy, as many as exist where fewer do. There are 200 sums of 2 terms, all in the pool, so none
# is held out; of the 4,000 of 3 terms most are in the pool or the SFT data. Each figure's count is printed beside it
eval_per_bin = 100
eval_sampled = True         # also pass@1, pass@8 and pass@64 at temperature 1, before and after RL, per difficulty,
eval_k = 64
eval_k_per_bin = 10         # ... on the first 10 problems of each number of terms (the default's time)
# accuracy counts right answers only (a score of 1). The RL reward keeps reasoning-gym's partial credit: its
# score_answer gives 0.67 to a wrong answer that contains the right one ("-40" or "1-4" for -4), and RL trains on that
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
# warm start: SFT on the exact traces of 2 to 4 terms; it is right on 3-4, then falls off with each term past them.
# It trains until it fits: until its loss, the mean of its last 50 steps, is 0.002 or less, at most 6000 steps (the
# cosine's length). A fixed 1600 left some seeds at ten times the loss of others, and RL nearly flat on them; 0.005 in
# at most 3000 left one seed in three short of the target and two of three at 0.90-0.93 greedy on 4 terms
sft_loss = 0.002
sft_steps = 6000
sft_batch = 16
sft_lr = 2e-3
prompts_per_step = 16
group_size = 8
max_new_tokens = 64         # a 12-term trace is 48 characters and its answer line 9
lr = 2e-4
# four optimizer steps a batch, on its four quarters (the same forwards and backwards): over 3 seeds RL's pass@1 on
# 5-8 terms 0.694 against one step's 0.660, greedy 0.781 against 0.725 (`python -m bench recipe --records ws-813abf77`:
# baseline against mb1); with more than one step a batch the clip binds (update.py)
minibatches = 4
steps = 100
warmup_steps = 5
micro_batch = 64
eval_every = 20             # held-out greedy accuracy every 20 steps: the curve in run.png
save_every = 20
# stage 1 (config.py's defaults): the growth-zone sampler keeps prompts whose pass rate is in (0.1, 0.9), so the
# curriculum follows the policy from 5 terms outward as it learns them. Of 20,000 prompts each is seen about once, so
# the flat prior makes the sampler nearly uniform; --zone_prior=difficulty gives a prompt its number of terms' pooled
# pass rate as its prior. Over 3 seeds that drew 10% fewer rollouts for the same kept groups but neither learned
# better nor ran faster (its draws are longer sums, `python -m bench recipe`), so the default keeps the flat prior
