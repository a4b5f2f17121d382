"""What `accelerate launch --config_file CONFIG FLAGS -m specdraft train ...` decides, from accelerate's own code and
without starting a process: the arguments it gives torchrun (nodes, processes per node, this node's rank, the
rendezvous) and the environment every process gets (ACCELERATE_USE_FSDP, FSDP_*, the DeepSpeed config)."""

from argparse import Namespace
from pathlib import Path

from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

ACCELERATE_CONFIGS = Path(__file__).resolve().parent.parent / "recipes" / "accelerate"


def launch_plan(config: Path, *flags: str) -> tuple[Namespace, dict[str, str]]:
    """accelerate's launch_command up to the launcher it picks (accelerate/commands/launch.py)."""
    args = launch_command_parser().parse_args(["--config_file", str(config), *flags, "-m", "specdraft", "train", "R"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]
    return args, prepare_multi_gpu_env(args)
