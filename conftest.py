# Tests run on the CPU: Triton kernels go through its interpreter, which must be chosen before triton is imported.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))
