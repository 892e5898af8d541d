# python train.py configs/gsm8k_qwen3.py
# One GPU (about 40 GB is plenty): GRPO on GSM8K from Qwen3-0.6B. Needs a network for the model and the data.
# Status: not yet run on a GPU.
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
micro_batch = 8         # sequences per forward/backward: trade memory for speed
eval_every = 50
save_every = 50
