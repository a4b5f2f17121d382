"""`specdraft train` under accelerate's own FSDP2 plugin, on CPU processes: what tests/test_fsdp_cpu.py launches
with torchrun (gloo).

    torchrun --nproc_per_node N tests/accelerate_fsdp_cpu.py train RECIPE [--resume] ...

accelerate selects FSDP only when its process-level state says accelerator devices (``accelerate/state.py``: the
FSDP branch is taken for MULTI_GPU and its kin, never for MULTI_CPU), and on CPU `specdraft train` refuses an FSDP
launch for that reason (``train_parts.check_fsdp``). This runner sets that one field, the distributed type of
accelerate's process state, to MULTI_GPU after the gloo process group is up; everything after it is accelerate's
FSDP2 code path as on GPUs (the plugin read from the FSDP_* environment `accelerate launch --config_file
recipes/accelerate/fsdp.yaml` sets, ``fully_shard`` at prepare, its gradient clipping and accumulation) and
specdraft's loop and checkpoints, unchanged. FSDP_AUTO_WRAP_POLICY may be set by the caller (default NO_WRAP, as
the shipped configs).
"""

import os
import sys

import probe_family  # noqa: F401  (registers the "probe" family)
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from specdraft.cli import main

# What `accelerate launch --config_file recipes/accelerate/fsdp.yaml` puts in the environment (less bf16: CPU runs
# compare float32 weights).
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "NO_WRAP",
            "FSDP_MIN_NUM_PARAMS": "1000000", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
            "FSDP_OFFLOAD_PARAMS": "false", "FSDP_RESHARD_AFTER_FORWARD": "true"}

if __name__ == "__main__":
    torch.set_num_threads(1)
    for key, value in FSDP_ENV.items():
        os.environ.setdefault(key, value)
    PartialState(backend="gloo")
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    sys.exit(main())
