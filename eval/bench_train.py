"""Training throughput: tokens/s, a step against the target forward alone, and peak memory.

    python eval/bench_train.py --target smollm2-135m-instruct         # EAGLE-1 and EAGLE-3, online and offline
    python eval/bench_train.py --target toy --families eagle3 --modes online
    python eval/bench_train.py --target smollm2-135m-instruct --set training.mixed_precision=bf16
    python eval/bench_train.py --target smollm2-135m-instruct --families eagle3 --modes online \
        --data WORK/data/answers.jsonl --baseline-tree /tmp/old --repeats 2     # chat answers; old code vs this
    python eval/bench_train.py --target smollm2-135m-instruct --families eagle3 --modes online \
        --set data.packing=true --set data.tokens_per_micro_batch=2048 --compare training.compile=true  # compiled
    python eval/bench_train.py --device cuda --target llama3.1-8b-random --families eagle3 --modes online \
        --max-length 2048 --set data.packing=true --set data.tokens_per_micro_batch=16384 \
        --set training.mixed_precision=bf16 --compare training.compile=true      # Llama-3.1-8B's shapes, no download

Each configuration runs the real ``specdraft train`` path with recipes/<target>-<family>.yaml, in a
fresh process so that its peak memory is its own, on the same plain-text chunks of the standard
library's source (training files of the toy target), or on chat answers (``--data``: messages JSONL, e.g. the
target's own answers that eval/bench_families.py writes, packed as the recipes pack them). ``--baseline-tree DIR``
runs every configuration also on the ``specdraft`` package of another checkout (``git archive COMMIT | tar -x -C
DIR``), alternating baseline and this tree ``--repeats`` times, and prints each one's median; ``--compare
KEY=VALUE`` alternates each configuration with and without those overrides the same way. ``offline`` first
writes the target's features with ``cache-features`` and then trains from them (the target forward leaves the
step). The loop times the target forward inside each step, so tokens/s and the target's share come from the same
run; the figures are those of the second logging window (warm). Host timers: exact on CPU; on
CUDA run with CUDA_LAUNCH_BLOCKING=1 for a meaningful split. ``shapes`` counts the distinct batch shapes the
drafter met in training (one with data.tokens_per_micro_batch).

MFU (EAGLE-1 and EAGLE-3; "-" elsewhere, and on a device whose bf16 peak is not in ``PEAK_BF16``) is training
tokens/s x FLOPs per token / the card's dense bf16 peak, with the FLOPs counted analytically (2 per multiply-add;
a frozen forward once, a trained one 3 times, for its backward; causal attention over c = half a row of T
tokens; target: L layers of hidden H, MLP width I, K/V width H_kv; E = the matmul weights of one decoder layer,
2 H^2 + 2 H H_kv + 3 H I):
    target forward          2 L E + 4 L c H + 2 R H      R = the logit rows it computes (EAGLE-3: its draft
                                                         vocabulary N; EAGLE-1: the whole vocabulary V)
    EAGLE-3 drafter         3 [2 (3H) H + S (2 E_3 + 2 N H + 4 c H)]      S training-time-test steps, E_3 = E
                                                                          with 2H-wide inputs to q, k and v
    EAGLE-1 drafter         3 [2 (2H) H + 2 E + 4 c H] + 4 V H            the target's frozen head: forward and
                                                                          the gradient of its input
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE_PREFIX = {"smollm2-135m-instruct": "smollm2-135m-", "toy": "toy_", "llama3.1-8b-random": "llama3.1-8b-",
                 "llama3.1-8b-random-tiny": "llama3.1-8b-"}
# Llama-3.1-8B's config (meta-llama/Llama-3.1-8B-Instruct, config.json), for a target of random bf16 weights: a
# step's time does not depend on the weights. "-tiny" keeps the vocabulary and the RoPE and shrinks the rest, for
# a CPU; both tokenize with the toy target's tokenizer (its ids are all within the vocabulary).
LLAMA31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 128000,
              "eos_token_id": [128001, 128008, 128009],
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}


def random_llama_target(folder: Path, tiny: bool) -> Path:
    """A Llama-3.1-8B-shaped target folder with random bf16 weights (N(0, 0.02), norms at 1) and the toy's
    tokenizer, built on the GPU when there is one."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdraft.toy_target import toy_target_path

    config = LlamaConfig(**{**LLAMA31_8B, **(TINY if tiny else {})}, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0) if "norm" in name else parameter.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(toy_target_path()).save_pretrained(folder)
    return folder
# Dense bf16 peaks (FLOP/s), by a name torch.cuda.get_device_name() contains: the vendors' datasheets (SXM parts).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def flops_per_token(family: str, target_config, drafter, row_length: int) -> float | None:
    """The docstring's FLOPs per training token, or None for a family it does not count."""
    c = target_config
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (getattr(c, "head_dim", None) or H // c.num_attention_heads)
    E, ctx = 2 * H * H + 2 * H * kv + 3 * H * I, row_length / 2
    if family == "eagle3":
        N, S = drafter.draft_vocab_size or c.vocab_size, drafter.ttt_steps
        E3 = E + H * H + 2 * H * kv  # q, k and v read 2H
        target = 2 * L * E + 4 * L * ctx * H + 2 * N * H
        return target + 3 * (2 * 3 * H * H + S * (2 * E3 + 2 * N * H + 4 * ctx * H))
    if family == "eagle1":
        V = c.vocab_size
        target = 2 * L * E + 4 * L * ctx * H + 2 * V * H
        return target + 3 * (2 * 2 * H * H + 2 * E + 4 * ctx * H) + 4 * V * H
    return None


def text_data(path: Path, n_files: int, chars: int) -> Path:
    from specdraft.toy_target import list_source_files, toy_target_path

    heldout = set(json.loads((toy_target_path() / "build_record.json").read_text())["heldout_files"])
    files = [text for rel, text in sorted(list_source_files().items()) if rel not in heldout][:n_files]
    path.write_text("".join(json.dumps({"text": t[:chars]}) + "\n" for t in files))
    return path


def time_alternately(target_forward, drafter_step, module, attribute: str, variants: dict, repeats: int):
    """Rounds of: the target's forward, then ``drafter_step(example)`` once with ``module.attribute`` set to each
    variant in turn (the original put back at the end). The first round warms up. Returns the minimum seconds
    of the later rounds ("target" and each variant's name), each variant's last ``drafter_step`` value, and the
    last example."""
    original = getattr(module, attribute)
    times = {"target": [], **{name: [] for name in variants}}
    values = {}
    try:
        for _ in range(repeats + 1):
            started = time.perf_counter()
            example = target_forward()
            times["target"].append(time.perf_counter() - started)
            for name, variant in variants.items():
                setattr(module, attribute, variant)
                started = time.perf_counter()
                values[name] = drafter_step(example)
                times[name].append(time.perf_counter() - started)
    finally:
        setattr(module, attribute, original)
    return {name: min(seconds[1:]) for name, seconds in times.items()}, values, example


def one_configuration(config: dict) -> dict:
    """Train ``config["steps"]`` steps of one family in one mode, in this process; return its figures."""
    from specdraft.config import load_recipe
    from specdraft.features import cache_features
    from specdraft.train import train

    from specdraft import train as loop
    from specdraft.recipe_target import resolve_target_path
    from specdraft.target import load_target_config

    torch.set_num_threads(config["threads"])
    shapes = set()
    forward = loop.TrainStep.forward

    def counted_forward(self, batch, step, split="train"):
        if split == "train":
            shapes.add(tuple(batch["input_ids"].shape))
        return forward(self, batch, step, split)

    loop.TrainStep.forward = counted_forward
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = []
        if config["target"].startswith("llama3.1-8b-random"):
            folder = random_llama_target(tmp / "target", tiny=config["target"].endswith("-tiny"))
            target = [f"target.path={folder}", "data.eval_fraction=0.02", "tracking.trackers=[none]",
                      "training.epochs=null"]  # the 8B recipes train for epochs; the bench, for --steps
        if config["data"]:
            data_overrides = [f"data.path={config['data']}", "data.format=messages", "data.eval_fraction=0"]
        else:
            data = text_data(tmp / "text.jsonl", n_files=400, chars=16 * config["max_length"])
            data_overrides = [f"data.path={data}", "data.format=text"]
        overrides = data_overrides + [f"data.max_length={config['max_length']}",
            f"training.max_steps={config['steps']}", f"training.micro_batch_size={config['micro_batch']}",
            "training.grad_accumulation=1", f"training.log_every={config['steps'] // 2}", "training.eval_every=0",
            f"checkpoint.save_every={config['steps']}", f"checkpoint.output_dir={tmp / 'run'}", "eval.enabled=false",
        ] + target + config["overrides"]
        cache_seconds = None
        if config["mode"] == "offline":
            overrides.append(f"training.feature_cache={tmp / 'features'}")
            started = time.perf_counter()
            cache_features(load_recipe(config["recipe"], overrides), show_progress=False)
            cache_seconds = time.perf_counter() - started
        recipe = load_recipe(config["recipe"], overrides)
        run_dir = train(recipe, show_progress=False)
        logs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        target_config = load_target_config(resolve_target_path(recipe.target.path, recipe.target.dtype))
    warm = [entry for entry in logs if "train/tokens_per_s" in entry][-1]
    row = max(width for _, width in shapes)
    flops = flops_per_token(config["family"], target_config, recipe.drafter, row)
    peak = None
    if torch.cuda.is_available():
        peak = next((value for name, value in PEAK_BF16.items() if name in torch.cuda.get_device_name()), None)
    return {"tokens_per_s": warm["train/tokens_per_s"], "target_fraction": warm["train/target_fraction"],
            "shapes": len(shapes), "mfu": warm["train/tokens_per_s"] * flops / peak if flops and peak else None,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_cuda_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "cache_features_seconds": cache_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy", choices=sorted(RECIPE_PREFIX))
    parser.add_argument("--families", nargs="+", default=["eagle1", "eagle3"])
    parser.add_argument("--modes", nargs="+", default=["online", "offline"], choices=["online", "offline"])
    parser.add_argument("--steps", type=int, default=None, help="default: 40 on the toy, 12 on SmolLM2")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per step (default: 8 toy, 4 SmolLM2)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per row (default: 256 toy, 512 SmolLM2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--data", default=None, help="chat answers (messages JSONL) instead of plain text")
    parser.add_argument("--baseline-tree", default=None, type=Path,
                        help="another checkout's root: each configuration also runs on its specdraft package")
    parser.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE",
                        help="each configuration also runs with these overrides added (alternated with the plain "
                             "one), e.g. training.compile=true")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (alternated); medians")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one configuration, in its own process
        print("RESULT " + json.dumps(one_configuration(json.loads(args.child))))
        return 0

    small = args.target in ("toy", "llama3.1-8b-random-tiny")
    steps = args.steps or (40 if small else 12)
    micro_batch, max_length = args.micro_batch or (8 if small else 4), args.max_length or (256 if small else 512)
    trees = {"baseline": args.baseline_tree.resolve(), "this tree": REPO} if args.baseline_tree else {"this tree": REPO}
    # (name, tree, added overrides), alternated within each repeat
    variants = [(name, tree, []) for name, tree in trees.items()]
    if args.compare:
        variants += [(f"{name} + {' '.join(args.compare)}", tree, args.compare) for name, tree in trees.items()]
    rows = []
    for family in args.families:
        recipe = REPO / "recipes" / f"{RECIPE_PREFIX[args.target]}{family}.yaml"
        for mode in args.modes:
            config = {"family": family, "mode": mode, "recipe": str(recipe), "steps": steps, "threads": args.threads,
                      "target": args.target,
                      "micro_batch": micro_batch, "max_length": max_length, "overrides": args.set,
                      "data": str(Path(args.data).resolve()) if args.data else None}
            runs = {name: [] for name, _, _ in variants}
            for repeat in range(args.repeats):
                for name, tree, added in variants:  # alternated, so a drift in the machine's speed hits each
                    print(f"{family} {mode} ({name}, run {repeat + 1}): {steps} steps ...", flush=True)
                    path = [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
                    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
                    if args.device == "cpu":
                        env["ACCELERATE_USE_CPU"] = "1"
                    child = {**config, "overrides": config["overrides"] + added}
                    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(child)], check=False,
                                          capture_output=True, text=True, env=env)
                    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                    if done.returncode or not result:
                        print(done.stdout[-2000:], done.stderr[-4000:], sep="\n")
                        return 1
                    runs[name].append(json.loads(result[-1][len("RESULT "):]))
            for name, results in runs.items():
                median = {key: statistics.median(r[key] for r in results) if isinstance(results[0][key], (int, float))
                          else results[0][key] for key in results[0]}
                rows.append({**config, **median, "tree": name})

    budget = [int(o.split("=", 1)[1]) for o in args.set if o.startswith("data.tokens_per_micro_batch=")]
    batch_shape = (f"{budget[-1] // max_length} packed rows x {max_length} tokens (a token budget)" if budget
                   else f"micro-batch {micro_batch} x {max_length} tokens")
    print(f"\n## bench_train: {args.target} on {rows[0]['device']}, torch {torch.__version__}, "
          f"{args.threads} thread(s), "
          f"{batch_shape}, {steps} steps (figures of the warm second half)"
          + (f", overrides {' '.join(args.set)}" if args.set else "")
          + (f", chat answers {args.data}" if args.data else ", plain text")
          + (f", median of {args.repeats} alternated runs" if args.repeats > 1 else ""))
    print(f"`python eval/bench_train.py {' '.join(sys.argv[1:])}`\n")
    print("| drafter | code | mode | training tokens/s | target forward share of a step | step / target forward "
          "| MFU | shapes | peak RSS GiB | peak GPU GiB | cache-features s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        share = row["target_fraction"]
        ratio = f"{1 / share:.2f}x" if share > 0 else "- (no target forward)"
        cache = f"{row['cache_features_seconds']:.0f}" if row["cache_features_seconds"] is not None else "-"
        gpu = f"{row['peak_cuda_gib']:.2f}" if row["peak_cuda_gib"] is not None else "-"
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        print(f"| {row['family']} | {row['tree']} | {row['mode']} | {row['tokens_per_s']:.0f} | {share:.1%} | {ratio} "
              f"| {mfu} | {row['shapes']:.0f} | {row['peak_rss_gib']:.2f} | {gpu} | {cache} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
