# python train.py configs/longcot.py
# The CPU long-CoT default for stage 2's sparse decode: the synthetic task at 16 to 24 terms, so a rollout runs to
# 200-370 cached tokens (25 to 46 pages of 8): long enough for the KV budget to matter, short enough for a CPU.
# The same 0.8M-parameter model as configs/sharpen.py; everything not set here is the Config default.
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
# warm start: a curriculum. From scratch, 400 SFT steps on chains of 2 to 24 stay on the plateau (final SFT loss
# 1.29, as the run prints it); from configs/sharpen.py's warm start (chains of 2 to 8, built first if needed), 200
# steps reach 0.11
sft_init = "configs/sharpen.py"
sft_difficulty = (2, 24)
sft_steps = 200
sft_batch = 16
sft_lr = 1e-3
sft_noise = 0.6
prompts_per_step = 8
group_size = 8
max_new_tokens = 224
lr = 2e-4
steps = 24
warmup_steps = 3
refill_tries = 1        # one refill at most: a long-CoT rollout is the expensive part of a step
micro_batch = 16
eval_every = 8
save_every = 8
# stage 2: the p5-held schedule. Calibrated on the warm start before step 0 (calibrate.py's sweep, written to
# out_dir/kv_schedule.json), then held at p5 alpha >= 0.86 per bin by the controller. Pages of 8 tokens, bins of
# 8 pages (64 tokens: Sparrow's 2,048-token bins scaled to the task), the first of the 4 layers dense.
page_size = 8
kv_bin_pages = 8
dense_layers = 1
kv_budget = "calibrate"
kv_controller = True
kv_candidates = (3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48)
calib_prompts = 16
kv_compare_every = 5    # every 5 steps, the same prompts on a dense engine: the speedup, measured in the run
