"""`specdraft train` under accelerate's own FSDP2 plugin, on CPU processes: what tests/test_fsdp_cpu.py launches
with torchrun (gloo).

    torchrun --nproc_per_node N tests/accelerate_fsdp_cpu.py train RECIPE [--resume] ...

accelerate selects FSDP only when its process-level state says accelerator devices (``accelerate/state.py``: the
FSDP branch is taken for MULTI_GPU and its kin, never for MULTI_CPU), and on CPU `specdraft train` refuses an FSDP
launch for that reason (``train_parts.check_fsdp``). This runner sets that one field, the distributed type of
accelerate's process state, to MULTI_GPU after the gloo process group is up; everything after it is accelerate's
FSDP2 code path as on GPUs (the plugin read from the FSDP_* environment `accelerate launch --config_file
recipes/accelerate/fsdp.yaml` sets, ``fully_shard`` at prepare, its gradient clipping and accumulation) and
specdraft's loop and checkpoints, unchanged. The FSDP settings are the ones `accelerate launch` derives from the
shipped recipes/accelerate/fsdp.yaml; a variable the caller sets (FSDP_AUTO_WRAP_POLICY=...) replaces its own.
"""

import os
import sys

import probe_family  # noqa: F401  (registers the "probe" family)
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from accelerate_launch import ACCELERATE_CONFIGS, launch_plan

from specdraft.cli import main

if __name__ == "__main__":
    torch.set_num_threads(1)
    _, launch_env = launch_plan(ACCELERATE_CONFIGS / "fsdp.yaml", "--num_processes", os.environ["WORLD_SIZE"],
                                "--main_process_port", "0")
    for key, value in launch_env.items():
        if key == "ACCELERATE_USE_FSDP" or key.startswith("FSDP_"):
            os.environ.setdefault(key, value)
    PartialState(backend="gloo")
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    sys.exit(main())
