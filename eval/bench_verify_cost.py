"""Benchmark: what a verify forward of n tokens costs on this machine, and the chain length K it makes best.

    python eval/bench_verify_cost.py --target smollm2-135m-instruct
    python eval/bench_verify_cost.py --target smollm2-135m-instruct --results bench-families/results.json

The speedup theorem (Leviathan et al. 2023) assumes one forward over K+1 positions costs one plain step.
On a CPU it does not: this times the target's forward over n = 1..--max-n new tokens after a
--context-token prompt, through the decoder's own call (KV-cached, float32), and prints
v(n) = t(n) / t(1).

With --results (eval/bench_families.py's results.json), it also predicts, for each method, the
speedup at every K from that run's per-position acceptance a_i (the rate at which draft i is accepted
once drafts 1..i-1 were) and draft cost c:

    tau(K) = 1 + sum_{j<=K} prod_{i<=j} a_i,        speedup(K) = tau(K) / (v(K+1) (1 + K c))

so the K that a CPU rewards can be read next to the K=5 the benchmark decoded with. Positions the run
never reached (a_i unknown) end the table for that method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from specdraft.target import FrozenTarget, resolve_target_path


def forward_seconds(target, context: int, n: int, repeats: int) -> float:
    """Median seconds of one forward over n new tokens on a KV cache holding ``context`` tokens."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (1, context), generator=generator)
    new = torch.randint(0, target.vocab_size, (1, n), generator=generator)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(prompt, past_key_values=cache, use_cache=True, logits="last")
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            target(new, past_key_values=cache, use_cache=True)  # every position's logits, as a verify
            times.append(time.perf_counter() - start)
            cache.crop(-n)  # back to the context: every repeat verifies at the same length
    return statistics.median(times[1:])


def chain_tau(acceptance: list[float | None], k: int) -> float | None:
    """Expected tokens per step with K drafts, from per-position conditional acceptance."""
    tau, reach = 1.0, 1.0
    for rate in acceptance[:k]:
        if rate is None:
            return None
        reach *= rate
        tau += reach
    return tau if len(acceptance) >= k else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=300, help="tokens already in the KV cache")
    parser.add_argument("--max-n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", default=None, help="a results.json of eval/bench_families.py")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = FrozenTarget.from_pretrained(resolve_target_path(args.target, "float32"), dtype="float32")
    seconds = {n: forward_seconds(target, args.context, n, args.repeats) for n in range(1, args.max_n + 1)}
    cost = {n: s / seconds[1] for n, s in seconds.items()}
    print(f"## Verify cost on {args.target} (float32, {args.threads} thread(s), {args.context}-token context, "
          f"median of {args.repeats})\n")
    print("| new tokens n | ms per forward | v(n) = t(n) / t(1) |\n|---:|---:|---:|")
    for n, s in seconds.items():
        print(f"| {n} | {s * 1e3:.1f} | {cost[n]:.2f} |")
    if not args.results:
        return

    results = json.loads(Path(args.results).read_text())
    for temperature, result in results["eval"].items():
        ks = range(1, args.max_n)
        print(f"\n### speedup predicted at each K with these v(K+1), temperature {temperature}\n")
        print("| method | " + " | ".join(f"K={k}" for k in ks) + " | best K |\n|---" + "|---:" * (len(ks) + 1) + "|")
        for method, groups in result["methods"].items():
            s = groups["overall"]
            if not s.get("position_acceptance") or s.get("draft_cost_ratio") is None:
                continue
            predicted = {}
            for k in ks:
                tau = chain_tau(s["position_acceptance"], k)
                if tau is not None:
                    predicted[k] = tau / (cost[k + 1] * (1 + k * s["draft_cost_ratio"]))
            best = max(predicted, key=predicted.get)
            cells = [f"{predicted[k]:.2f}x" if k in predicted else "-" for k in ks]
            print(f"| {method} | " + " | ".join(cells) + f" | {best} |")


if __name__ == "__main__":
    main()
