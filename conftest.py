# Tests run on the CPU: Triton kernels go through its interpreter, which must be chosen before
# triton is imported.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine
