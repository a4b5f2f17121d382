"""Multi-node launches: the shipped 2 nodes x 8 GPUs accelerate configs, read by accelerate's own config loader and
launch code, and `specdraft train` launched as 2 "nodes" on localhost (CPU processes over gloo, one process per node,
two `accelerate launch` commands meeting at 127.0.0.1), which trains the weights one process does."""

import json
import os
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType
from accelerate_launch import ACCELERATE_CONFIGS, launch_plan
from spine import (DDP_ENV, SAME_WEIGHTS_REL, assert_same_weights, drafter_weights, free_port,
                   largest_relative_change, make_chat_data, make_recipe, write_recipe)
from tiny import save_tiny_target

from specdraft.checkpoint import checkpoint_dirs

# each 2-node config and the single-node config it carries over to two nodes
MULTI_NODE = {"ddp_2x8": "ddp_8gpu", "deepspeed_zero2_2x8": "deepspeed_zero2", "deepspeed_zero3_2x8": "deepspeed_zero3",
              "fsdp_2x8": "fsdp"}
SETTINGS = ("distributed_type", "mixed_precision", "deepspeed_config", "fsdp_config", "use_cpu")


@pytest.mark.parametrize("name", sorted(MULTI_NODE))
def test_the_two_node_configs_are_the_single_node_ones_on_16_processes(name):
    config = load_config_from_file(str(ACCELERATE_CONFIGS / f"{name}.yaml"))
    single = load_config_from_file(str(ACCELERATE_CONFIGS / f"{MULTI_NODE[name]}.yaml"))
    assert isinstance(config, ClusterConfig)
    assert (config.num_machines, config.num_processes, config.machine_rank) == (2, 16, 0)
    assert config.main_process_ip is None, "node 0's address is the user's, given on the command line"
    assert config.main_process_port and config.rdzv_backend == "static"
    assert single.num_machines == 1
    for field in SETTINGS:
        ours, theirs = getattr(config, field), getattr(single, field)
        if field == "deepspeed_config" and ours:  # every node starts its own processes: no pdsh, no hostfile
            ours = {k: v for k, v in ours.items() if k != "deepspeed_multinode_launcher"}
            assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
        assert ours == theirs, field


@pytest.mark.parametrize("name", sorted(MULTI_NODE))
@pytest.mark.parametrize("node", [0, 1])
def test_each_node_launches_8_of_16_processes_meeting_at_node_0(name, node):
    """accelerate's own launch code, as on each node: `--machine_rank NODE --main_process_ip NODE0_IP`."""
    args, env = launch_plan(ACCELERATE_CONFIGS / f"{name}.yaml", "--machine_rank", str(node), "--main_process_ip",
                            "10.0.0.1")
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", node)
    assert args.rdzv_endpoint == "10.0.0.1:29500" and args.rdzv_backend == "static"
    kind = load_config_from_file(str(ACCELERATE_CONFIGS / f"{name}.yaml")).distributed_type
    if kind == DistributedType.DEEPSPEED:
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and args.deepspeed_multinode_launcher == "standard"
    if kind == DistributedType.FSDP:
        assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"], env["FSDP_AUTO_WRAP_POLICY"],
                env["FSDP_CPU_RAM_EFFICIENT_LOADING"]) == ("true", "2", "NO_WRAP", "false")


def test_two_nodes_on_localhost_train_the_weights_of_one_process(tmp_path):
    """Two `accelerate launch --num_machines 2 --machine_rank R` commands, one CPU process each: one run of 2
    processes (world size 2, one RNG file per rank), and the weights of 1 process with twice the accumulation."""
    target = save_tiny_target(tmp_path / "target", num_hidden_layers=4)
    data = make_chat_data(tmp_path / "chat.jsonl", n=24)
    recipes = {}
    for name, accumulation in (("nodes", 1), ("one", 2)):
        recipe = make_recipe(tmp_path / name, target, data,
                             training={"max_steps": 3, "grad_accumulation": accumulation},
                             checkpoint={"save_every": 1, "keep_last": 3})
        recipe["drafter"] = {"family": "eagle3", "ttt_steps": 2, "draft_vocab_size": None}
        recipe["target"]["taps"] = [1, 2, 3]
        recipes[name] = write_recipe(tmp_path / f"{name}.yaml", recipe)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **DDP_ENV}
    one = subprocess.run([sys.executable, "-m", "specdraft", "train", str(recipes["one"]), "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]

    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
                               "--machine_rank", str(node), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
                               "--main_process_port", port, "--mixed_precision", "no", "--dynamo_backend", "no",
                               "-m", "specdraft", "train", str(recipes["nodes"]), "--no-progress"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]

    last = checkpoint_dirs(tmp_path / "nodes" / "run")[-1]
    assert json.loads((last / "trainer_state.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in last.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    two, single = drafter_weights(tmp_path / "nodes" / "run"), drafter_weights(tmp_path / "one" / "run")
    assert_same_weights(two, single)
    first = drafter_weights(checkpoint_dirs(tmp_path / "one" / "run")[0])
    assert largest_relative_change(single, first) > SAME_WEIGHTS_REL  # training moved them
