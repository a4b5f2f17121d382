"""What a decode step's target forward costs on this device, per width and batch size, and the speedup
that predicts from the proposals a run actually made.

Leviathan et al.'s speedup, tau / (v (1 + K c)), assumes K drafts every step and a verify cost v that does
not depend on the batch. Neither holds: prompt lookup proposes nothing where it finds no match (a step of
width 1), a compiled verify always runs K+1 wide, and a CPU's (or a large batch's) forward over K+1
positions costs more than one over 1. So the cost is measured as a curve, seconds per step of each
``kind`` (plain, chain verify, tree verify) at each ``width`` (positions per row) and batch size, through the
decoders themselves with a source that proposes a fixed number of drafts (``FixedProposal``): everything a
step does except drafting (forward, verify, cache rollback, host sync, loop). A run's decodes record every
forward they made (``DecodeOutput.forwards``: kind, width, drafting seconds), so

    predicted seconds of a decode = its prefill + sum over its forwards (v(kind, width, batch) t_plain + drafting)
    predicted speedup = (tokens / predicted seconds) / (plain decoding's tokens / seconds)

with v = curve(kind, width, batch) / curve(plain, 1, batch) the relative cost of a step, t_plain the seconds of
a plain step at that batch size in the same run (so the context lengths and the machine's load of the run set
the scale, and the curve only the shape), and the prefill and the drafting as measured in the run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from specdraft.contract import DraftCapabilities, Proposal
from specdraft.decoding.rows import fresh_sources
from specdraft.decoding.speculative import speculative_decode_batch
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.speculative import (
    DecodeOutput,
    TreeDrafting,
    plain_decode,
    speculative_decode,
)
from specdraft.decoding.trees import StaticTree


@dataclass
class ForwardCosts:
    """Seconds per decode step of (kind, width, batch) on one target and device: the curve."""

    seconds: dict[tuple[str, int, int], float] = field(default_factory=dict)
    device: str = ""
    context: int = 0  # prompt tokens in the cache when it was measured

    def __call__(self, kind: str, width: int, batch: int) -> float:
        """Measured, or linear in the width between (or beyond) the two nearest measured widths of that kind
        and batch (``measure_forward_costs`` samples a kind with many widths, EAGLE-2's dynamic trees)."""
        if (kind, width, batch) in self.seconds:
            return self.seconds[(kind, width, batch)]
        known = sorted(w for k, w, b in self.seconds if (k, b) == (kind, batch))
        if len(known) < 2:
            raise KeyError(f"no {kind} step at batch {batch} was measured at width {width} (measured: {known})")
        lower, upper = [w for w in known if w < width], [w for w in known if w > width]
        if lower and upper:
            w0, w1 = lower[-1], upper[0]
        else:  # beyond the measured widths: the line through the two nearest
            w0, w1 = upper[:2] if upper else lower[-2:]
        s0, s1 = self.seconds[(kind, w0, batch)], self.seconds[(kind, w1, batch)]
        return s0 + (s1 - s0) * (width - w0) / (w1 - w0)

    def relative(self, kind: str, width: int, batch: int) -> float:
        """v = a step's cost over a plain step's at the same batch size (1 at width 1 on an ideal device)."""
        return self(kind, width, batch) / self("plain", 1, batch)

    @classmethod
    def from_json(cls, data: dict) -> ForwardCosts:
        return cls({(e["kind"], e["width"], e["batch"]): e["seconds"] for e in data["seconds"]}, data["device"],
                   data["context"])

    def to_json(self) -> dict:
        return {"device": self.device, "context": self.context,
                "seconds": [{"kind": k, "width": w, "batch": b, "seconds": s}
                            for (k, w, b), s in sorted(self.seconds.items())]}  # fmt: skip


class FixedProposal:
    """A draft source that proposes ``drafts`` tokens every step (ids 1..n: a chain, or as a tree all children
    of the root), and that the target will mostly reject: a step of known width, for timing. Sampling (T > 0),
    it gives the V-wide draft distributions a drafter gives (``vocab``), so the verify does a drafter's work."""

    capabilities = DraftCapabilities(tree_kinds=("static",))

    def __init__(self, drafts: int, vocab: int | None = None):
        self.drafts, self.vocab = drafts, vocab

    def start(self, prompt_ids, target_out) -> None:
        pass

    def propose(self, pending, k, params, generator) -> Proposal:
        tokens = torch.arange(1, 1 + min(self.drafts, k), device=pending.device)[None]
        return Proposal(tokens, self._probs(tokens, params))

    def propose_tree(self, pending, tree, params, generator) -> Proposal:
        tokens = torch.arange(1, 1 + tree.num_nodes, device=pending.device)[None]
        return Proposal(tokens, self._probs(tokens, params), torch.tensor([tree.parents], device=pending.device))

    def _probs(self, tokens, params) -> torch.Tensor | None:
        if params.is_greedy or self.vocab is None:
            return None
        return torch.nn.functional.one_hot(tokens, self.vocab).float()

    def commit(self, kept_ids, target_out) -> None:
        pass


def flat_tree(nodes: int):
    """A depth-1 static tree of ``nodes`` children of the root: a tree step of width nodes + 1."""
    return StaticTree(tuple((i,) for i in range(nodes)))


def step_decoder(target, prompt_ids: torch.Tensor, kind: str, width: int, batch: int, steps: int = 16,
                 compile_target: bool | str = False, params: SamplingParams = SamplingParams(),
                 verify_backend: str = "auto"):
    """A function that decodes ``steps`` steps of ``kind`` at ``width`` and ``batch`` with ``params`` and returns
    the seconds per step, drafting excluded: (wall clock - prefill - drafting) / steps, through the decoder a run
    uses (one prompt: ``speculative_decode`` / ``plain_decode``; a batch of copies: ``speculative_decode_batch``).
    Sampling costs more than greedy: every position's p, the race's noise, the exact verify."""
    if kind == "plain":
        source = None
    elif kind == "chain" or width == 1:  # a tree of no nodes is a chain of no drafts
        source = FixedProposal(width - 1, target.vocab_size)
    else:
        source = TreeDrafting(FixedProposal(width - 1, target.vocab_size), flat_tree(width - 1))
    k = max(width - 1, 1)  # a chain of width 1 proposes nothing (prompt lookup without a match)
    generator = torch.Generator(device=prompt_ids.device).manual_seed(0)
    common = dict(max_new_tokens=steps + 1, eos_token_ids=None, params=params, generator=generator)

    def decode() -> float:
        if batch > 1:
            sources = None if source is None else fresh_sources(source, batch)
            out = speculative_decode_batch(target, sources, [prompt_ids[0]] * batch, k=k,
                                           verify_backend=verify_backend, **common)[0]
        elif source is None:
            out = plain_decode(target, prompt_ids, compile_target=compile_target, **common)
        else:
            out = speculative_decode(target, source, prompt_ids, k=k, compile_target=compile_target,
                                     verify_backend=verify_backend, **common)
        drafting = sum(f.draft_seconds for f in out.forwards)
        return (out.seconds - out.prefill_seconds - drafting) / len(out.forwards)

    return decode


MAX_WIDTHS = 8  # measured per kind and batch; the curve is linear between them


def sampled_keys(keys) -> list[tuple[str, int, int]]:
    """``keys`` with plain at width 1 for every batch, and for a (kind, batch) with more than ``MAX_WIDTHS``
    widths, that many of them spread from the narrowest to the widest."""
    keys = set(keys) | {("plain", 1, batch) for _, _, batch in keys}
    kept = []
    for kind, batch in sorted({(k, b) for k, _, b in keys}):
        widths = sorted(w for k, w, b in keys if (k, b) == (kind, batch))
        if len(widths) > MAX_WIDTHS:
            widths = sorted({widths[round(i * (len(widths) - 1) / (MAX_WIDTHS - 1))] for i in range(MAX_WIDTHS)})
        kept += [(kind, w, batch) for w in widths]
    return kept


def measure_forward_costs(target, prompt_ids: torch.Tensor, keys, steps: int = 32, rounds: int = 5,
                          compile_target: bool | str = False, params: SamplingParams = SamplingParams(),
                          verify_backend: str = "auto") -> ForwardCosts:
    """The curve at ``keys`` ((kind, width, batch) triples, ``sampled_keys``), on ``prompt_ids`` [1, L], decoding
    with ``params`` (the run's): after a warm-up decode of each key (allocator, lazy initialisation,
    compilation), ``rounds`` rounds that each decode every key once, and per key the median over the rounds.
    Interleaved, so that a busy spell of the machine slows one round of every key rather than every round of one."""
    decoders = {key: step_decoder(target, prompt_ids, *key, steps, compile_target, params, verify_backend)
                for key in sampled_keys(keys)}
    for decode in decoders.values():
        decode()
    samples = {key: [] for key in decoders}
    for _ in range(rounds):
        for key, decode in decoders.items():
            samples[key].append(decode())
    return ForwardCosts({key: statistics.median(values) for key, values in samples.items()}, str(prompt_ids.device),
                        prompt_ids.shape[1])


def forward_keys(outputs: list[DecodeOutput]) -> set[tuple[str, int, int]]:
    """Every (kind, width, batch) the decodes ran: what the curve must price."""
    return {(f.kind, f.width, o.batch_rows) for o in outputs for f in o.forwards}


def plain_step_seconds(plain_outputs: list[DecodeOutput]) -> dict[int, float]:
    """Batch size -> seconds per plain decoding step in this run (prefill excluded): the unit a run's verify
    steps are priced in, measured beside them, at the same contexts and on the same busy or idle machine."""
    seconds, steps = {}, {}
    for o in plain_outputs:
        seconds[o.batch_rows] = seconds.get(o.batch_rows, 0.0) + o.seconds - o.prefill_seconds
        steps[o.batch_rows] = steps.get(o.batch_rows, 0) + len(o.forwards)
    return {batch: seconds[batch] / steps[batch] for batch in seconds if steps[batch]}


def predicted_seconds(output: DecodeOutput, costs: ForwardCosts, plain_step: dict[int, float]) -> float:
    """The decode call's wall clock as the curve prices it: the measured prefill (and source start), then each
    forward at the curve's relative cost of its kind and width at the call's batch size, in plain steps of this
    run (``plain_step``), plus that step's measured drafting."""
    batch = output.batch_rows
    return output.prefill_seconds + sum(costs.relative(f.kind, f.width, batch) * plain_step[batch] + f.draft_seconds
                                        for f in output.forwards)


def predicted_speedup_from_forwards(outputs: list[DecodeOutput], plain_outputs: list[DecodeOutput],
                                    costs: ForwardCosts) -> float | None:
    """(tokens / predicted seconds) over plain decoding's measured tokens/s, each decode priced by
    ``predicted_seconds`` (every row of a batch charged its call's clock, as tokens/s per request is measured)."""
    plain_step = plain_step_seconds(plain_outputs)
    if any(o.batch_rows not in plain_step for o in outputs):
        return None
    spec = sum(predicted_seconds(o, costs, plain_step) for o in outputs)
    plain = sum(o.seconds for o in plain_outputs)
    tokens, plain_tokens = sum(len(o.tokens) for o in outputs), sum(len(o.tokens) for o in plain_outputs)
    if not spec or not plain or not plain_tokens:
        return None
    return (tokens / spec) / (plain_tokens / plain)


def format_curve(costs: ForwardCosts) -> str:
    """A Markdown table: ms per step and v = step / plain step, one row per (kind, width), one column per batch."""
    batches = sorted({b for _, _, b in costs.seconds})
    rows = sorted({(k, w) for k, w, _ in costs.seconds}, key=lambda kw: (kw[0] != "plain", kw[0], kw[1]))
    lines = ["| step | width | " + " | ".join(f"batch {b}: ms (v)" for b in batches) + " |",
             "|---|---:|" + "---:|" * len(batches)]
    for kind, width in rows:
        cells = [f"{costs(kind, width, b) * 1e3:.2f} ({costs.relative(kind, width, b):.2f})"
                 if (kind, width, b) in costs.seconds else "-" for b in batches]
        lines.append(f"| {kind} | {width} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
