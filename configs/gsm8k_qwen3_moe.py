# python train.py configs/gsm8k_qwen3_moe.py
# One GPU, an H200: GRPO on GSM8K from Qwen3-30B-A3B (48 layers of 128 experts, 8 per token) with router replay.
# Needs a network for the model and the data. Status: NOT RUN; no step of it has been run on a GPU.
# Predicted by memory.py, not measured: peak memory 91.9 GiB, in the training forward, of an H200's 139.8 GiB: the
# bf16 weights 60.0 GiB (LoRA's 1.7B adapter parameters included), a micro-batch's activations 14.1 GiB, AdamW
# 6.3, the KV pool 6.6, the gradients 3.1. An H100 80GB (79.1 GiB) is too small: train.py refuses it at start
# (`python memory.py configs/gsm8k_qwen3_moe.py --gpu=H200` prints the breakdown). One step, every row to 512
# tokens, at least 8.2 s on an H200 by the cost model (bench/gpu.py's step_cost at the datasheet's rates: decode
# reads every expert's bf16 weights each step; no overheads, and none of the reference MoE's expert loop): a floor.
model = "Qwen/Qwen3-30B-A3B"
task = "gsm8k"          # openai/gsm8k, config "main": train for RL, test for held-out accuracy
n_train = 0
n_eval = 500
out_dir = "out/gsm8k_qwen3_30b_a3b"
dtype = "bfloat16"      # 30.5B parameters: 61 GB of bf16 weights, no fp32 master copy
autocast = "bfloat16"
# full fine-tuning would need about 4x the weights' memory for AdamW: train a LoRA adapter instead. LoRA leaves
# the router frozen, so replay here fixes the routing of the log-probs; the router's gradient flows but nothing
# updates it (moe_aux_coef has no parameter to move: keep it 0)
lora_r = 32
lora_alpha = 64
lr = 1e-5               # about 10x full fine-tuning's, as usual for LoRA
# the policy generates itself (rollout_copy = "same"): the engine's batched, cached bf16 decode still routes some
# tokens differently from the trainer's full-sequence forward; replay removes that difference
rollout_copy = "same"
router_replay = "update"
moe_aux_coef = 0.0
prompts_per_step = 16
group_size = 8
max_new_tokens = 512
temperature = 1.0
warmup_steps = 10
steps = 200
micro_batch = 2         # 48 layers of an expert loop (model.py's reference MoE): activations, not weights, decide
eval_every = 50
save_every = 50
