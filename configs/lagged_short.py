# python train.py configs/lagged_short.py
# The first stage of configs/lagged.py's warm start: SFT on the first 5 lines of lagged traces of
# 1 to 24 lines (sequences of at most 585 tokens: cheap), from a teacher that slips at one pair in
# 1,000 with chance 0.5 (tasks.lagged_trace). Alone it fails a line or two past those 5 lines;
# configs/lagged.py goes on from it on whole traces. The model of configs/sharpen.py (0.8M).
out_dir = "out/lagged_short"
task = "synthetic"
order = "lagged"
difficulty = (1, 24)
n_train = 2000
n_eval = 32
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
ffn = 384
sft_steps = 1200
sft_batch = 16
sft_lr = 2e-3
sft_slip = 0.5
sft_max_lines = 5
max_new_tokens = 1664
