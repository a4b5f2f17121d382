"""What a speculative decoding run is worth: pure functions of the decoder's per-step stats.

Notation (Leviathan et al. 2023, Sec. 3): K drafts per step, alpha the chance a draft is
accepted, c the cost of one draft token relative to one target forward.
  acceptance length tau = tokens emitted per target forward (accepted drafts + the bonus/corrected one)
  predicted speedup     = (1 - alpha^(K+1)) / ((1 - alpha)(1 + K c))      (Leviathan et al. 2023, Thm. 3.8)
The theorem assumes a verify forward over K+1 positions costs one plain decoding step. A GPU at
batch 1 is close to that; a CPU is not (SmolLM2-135M: 68 ms for 6 tokens against 42 ms for 1). So
the verify cost v = (seconds per verify step) / (seconds per plain-decoded token), both measured in
the same run, gives a second prediction, tau_expected / (v (1 + K c)), which explains the measured speedup.
Both assume K drafts every step and one verify cost at every batch size; the third prediction prices each
forward a run made at its width and batch on the device's measured curve (``verify_cost``).
"""

from __future__ import annotations

import math

from specdraft.decoding.speculative import DecodeOutput, StepStats
from specdraft.evaluation.verify_cost import ForwardCosts, predicted_speedup_from_forwards

MAX_RECOMMENDED_K = 16


def acceptance_length(steps: list[StepStats]) -> float:
    """tau: tokens per target forward in the decode phase, the bonus token included (plain decoding = 1)."""
    if not steps:
        return 1.0
    return sum(s.num_accepted + 1 for s in steps) / len(steps)


def position_acceptance(steps: list[StepStats], k: int) -> list[float | None]:
    """Rate at which draft i is accepted given drafts 1..i-1 were (the EAGLE papers' n-alpha).

    Draft i is tested in a step iff it was drafted and everything before it was accepted (a tree: its
    depth i was reached). None where no step ever reached position i.
    """
    reached, accepted = [0] * k, [0] * k
    for s in steps:
        for i in range(min(s.num_accepted + 1, s.max_accepted, k)):
            reached[i] += 1
            accepted[i] += i < s.num_accepted
    return [a / r if r else None for a, r in zip(accepted, reached)]


def measured_alpha(steps: list[StepStats]) -> float | None:
    """Accepted drafts / tested drafts: the maximum-likelihood alpha under i.i.d. acceptance. For a tree a
    depth is tested when the path reached it, and accepted when the path went one level deeper."""
    tested = sum(min(s.num_accepted + 1, s.max_accepted) for s in steps)
    return sum(s.num_accepted for s in steps) / tested if tested else None


def predicted_alpha(steps: list[StepStats]) -> float | None:
    """Mean of sum_x min(p, q) over the same tested positions: what theory expects ``measured_alpha`` to be."""
    values = [a for s in steps for a in s.alpha_predicted]
    return sum(values) / len(values) if values else None


def draft_cost_ratio(steps: list[StepStats]) -> float | None:
    """c = (draft seconds per drafted token) / (target seconds per verify forward)."""
    drafted = sum(s.num_drafted for s in steps)
    target_seconds = sum(s.target_seconds for s in steps)
    if not drafted or not target_seconds:
        return None
    return (sum(s.draft_seconds for s in steps) / drafted) / (target_seconds / len(steps))


def predicted_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected wall-clock speedup over plain decoding (Leviathan et al. 2023, Thm. 3.8), with a
    verify forward costing ``verify_cost`` plain steps (1 in the theorem)."""
    tokens_per_step = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens_per_step / (verify_cost * (1 + k * c))


def verify_cost(steps: list[StepStats], plain_outputs: list[DecodeOutput]) -> float | None:
    """v = target seconds per verify step / seconds per plain-decoded token, in the same run."""
    plain_tokens = sum(len(o.tokens) for o in plain_outputs)
    plain_seconds = sum(o.seconds for o in plain_outputs)
    if not steps or not plain_tokens or not plain_seconds:
        return None
    return (sum(s.target_seconds for s in steps) / len(steps)) / (plain_seconds / plain_tokens)


def recommended_k(alpha: float, c: float, max_k: int = MAX_RECOMMENDED_K) -> int:
    """The K in 1..max_k that maximises the predicted speedup."""
    return max(range(1, max_k + 1), key=lambda k: predicted_speedup(alpha, k, c))


def tokens_per_second(outputs: list[DecodeOutput]) -> float:
    """Per request: each decode's tokens over its own wall clock (a batch's, for a batched decode)."""
    seconds = sum(o.seconds for o in outputs)
    return sum(len(o.tokens) for o in outputs) / seconds if seconds else math.nan


def total_tokens_per_second(outputs: list[DecodeOutput]) -> float:
    """Throughput: every token over the wall clock spent, a batch's clock counted once (shared by its rows)."""
    seconds = sum(o.seconds / o.batch_rows for o in outputs)
    return sum(len(o.tokens) for o in outputs) / seconds if seconds else math.nan


def decode_tokens_per_second(outputs: list[DecodeOutput]) -> float:
    """Throughput of the decoding steps alone: the tokens after each decode's first (which the prefill
    draws) over the wall clock after its prefill, a batch's clock counted once."""
    seconds = sum((o.seconds - o.prefill_seconds) / o.batch_rows for o in outputs)
    return sum(len(o.tokens) - 1 for o in outputs) / seconds if seconds else math.nan


def summarize(outputs: list[DecodeOutput], k: int, plain_outputs: list[DecodeOutput] | None = None,
              costs: ForwardCosts | None = None) -> dict:
    """Every figure of one method on one group of prompts; ``plain_outputs`` are the same prompts decoded plainly.
    With ``costs`` (the device's verify-cost curve), the speedup predicted from the forwards the decodes made."""
    steps = [s for o in outputs for s in o.steps]
    alpha, c = measured_alpha(steps), draft_cost_ratio(steps)
    summary = {
        "num_decodes": len(outputs),
        "num_tokens": sum(len(o.tokens) for o in outputs),
        "acceptance_length": acceptance_length(steps),
        "position_acceptance": position_acceptance(steps, k) if steps else [],
        "alpha_measured": alpha,
        "alpha_predicted": predicted_alpha(steps),
        "draft_cost_ratio": c,
        "draft_seconds": sum(s.draft_seconds for s in steps),
        "target_seconds": sum(s.target_seconds for s in steps),
        "seconds": sum(o.seconds for o in outputs),
        "tokens_per_second": tokens_per_second(outputs),
        "total_tokens_per_second": total_tokens_per_second(outputs),
        "decode_tokens_per_second": decode_tokens_per_second(outputs),
        "speedup": None,
        "predicted_speedup": None,
        "recommended_k": None,
        "predicted_speedup_at_recommended_k": None,
        "verify_cost": None,
        "predicted_speedup_measured_verify": None,
        "predicted_speedup_from_proposals": None,
    }
    if plain_outputs:
        summary["speedup"] = summary["tokens_per_second"] / tokens_per_second(plain_outputs)
        summary["verify_cost"] = verify_cost(steps, plain_outputs)
        if costs is not None:  # every step as it was made (its width, batch and drafting), trees too
            summary["predicted_speedup_from_proposals"] = predicted_speedup_from_forwards(outputs, plain_outputs,
                                                                                          costs)
    # The predictions are a chain's (Leviathan et al.'s i.i.d. acceptance along K drafts): for a tree, alpha is
    # the rate at which the accepted path goes one level deeper, and c is per node, so none is predicted.
    is_tree = any(s.depth is not None for s in steps)
    if alpha is not None and c is not None and not is_tree:
        best_k = recommended_k(alpha, c)
        summary["predicted_speedup"] = predicted_speedup(alpha, k, c)
        if summary["verify_cost"] is not None:
            summary["predicted_speedup_measured_verify"] = predicted_speedup(alpha, k, c, summary["verify_cost"])
        summary["recommended_k"] = best_k
        summary["predicted_speedup_at_recommended_k"] = predicted_speedup(alpha, best_k, c)
    return summary
