import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402  (importing torch and asking for CUDA imports no triton)

# Must happen before anything imports triton. Without a GPU the kernels run in the interpreter on CPU;
# with one they are compiled and tested on it (tests/kernel_device.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)

# Keep derived caches (draft vocabularies) out of the user's home during tests.
import tempfile  # noqa: E402

os.environ.setdefault("SPECDRAFT_CACHE", tempfile.mkdtemp(prefix="specdraft-cache-"))
