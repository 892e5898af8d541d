# python train.py configs/gsm8k_qwen3.py
# One GPU: GRPO on GSM8K from Qwen3-0.6B. Needs a network for the model and the data. Status: not yet run on a GPU.
# Predicted, not measured: peak memory 50.4 GiB of an H100 80GB's 79.1, in the training forward: the KV pool
# 22.3 GiB (bf16, 32 x 8 rows of 768 tokens), a micro-batch's activations 15.2 GiB, AdamW 4.4, weights and gradients
# 2.2 each; 52.8 GiB with flash-attn installed (`python memory.py configs/gsm8k_qwen3.py` prints the breakdown).
# One step, every row to 768 tokens, at least 4.1 s on an H100 (3.2 s on an H200) by the cost model
# (bench/gpu.py's step_cost at the datasheets' rates, no overheads, one try): a floor, not an estimate.
model = "Qwen/Qwen3-0.6B"
task = "gsm8k"          # openai/gsm8k, config "main": train for RL, test for held-out accuracy
n_train = 0             # every training row
n_eval = 500
out_dir = "out/gsm8k_qwen3_0.6b"
autocast = "bfloat16"   # fp32 master weights, bf16 compute
prompts_per_step = 32
group_size = 8
max_new_tokens = 768
temperature = 1.0
lr = 1e-6               # full fine-tuning; LoRA wants about 10x more
warmup_steps = 10
steps = 300
micro_batch = 8         # sequences per forward/backward: trade memory for speed (4: 43.1 GiB predicted)
eval_every = 50
save_every = 50
