"""Benchmark: specdraft's speculative decoder vs plain decoding vs transformers' assisted generation.

Same target, same draft LM, same prompts, same process, all greedy:
  plain                 specdraft's plain_decode: one token per target forward (the speedup baseline)
  HF generate           model.generate(do_sample=False)
  HF assisted           model.generate(assistant_model=draft), K drafts per step
                        (constant schedule, confidence early-exit off: the same K as specdraft)
  specdraft, draft LM   speculative_decode with DraftLMSource(draft), K drafts per step
  specdraft, compiled   the same, the draft's decode step compiled (DraftLMSource(draft, compile=True));
                        transformers' assisted generation switches compilation off for its assistant
  HF prompt lookup      model.generate(prompt_lookup_num_tokens=K, max_matching_ngram_size=3)
  specdraft, lookup     speculative_decode with PromptLookupSource(max_ngram=3)
  --compile-target      also the compiled draft and prompt lookup with the target's verify compiled too
                        (speculative_decode(compile_target=True): K+1 wide over a static cache)
It checks every method emits the same tokens, and prints a Markdown table with tokens/s,
speedups, specdraft's ratio over its transformers counterpart, and the decoder efficiency =
measured speedup / speedup predicted from the measured alpha and c.

The draft is the target cut to its first ``--draft-layers`` layers (embeddings, final norm
and head kept), briefly distilled on the target's distribution (forward KL) over stdlib
source: a random draft would give alpha ~ 0 and say nothing.

  python eval/bench_decode.py                      # the shipped toy target
  python eval/bench_decode.py --target smollm2-135m-instruct --draft-layers 0   # a real chat model, lookup only
  python eval/bench_decode.py --target DIR --num-prompts 8 --max-new-tokens 128 -k 4

--draft-layers 0 leaves out the draft-LM rows (distilling a draft of a 135M target takes an hour on
2 CPU cores); plain decoding, transformers' generate and prompt lookup still run and are checked.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from specdraft.decoding.sources import DraftLMSource, PromptLookupSource
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.evaluation.metrics import (
    draft_cost_ratio,
    measured_alpha,
    predicted_speedup,
)
from specdraft.target import FrozenTarget, resolve_target_path


def stdlib_files(seed: int) -> list[Path]:
    """Standard-library modules (tests excluded), shuffled deterministically."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(root.rglob("*.py"))
             if not {"test", "tests", "idle_test", "site-packages"} & set(f.relative_to(root).parts)]  # fmt: skip
    random.Random(seed).shuffle(files)
    return files


def truncated_copy(model, num_layers: int):
    """The model with only its first ``num_layers`` decoder layers: a draft that starts out correlated."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = type(model)(config)
    kept = {name: w for name, w in model.state_dict().items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}  # fmt: skip
    draft.load_state_dict(kept, strict=False)
    return draft.to(next(model.parameters()).dtype).eval()


def distill(draft, target_model, token_rows: torch.Tensor, steps: int, batch_size: int, lr: float, seed: int):
    """Forward KL(p_target || q_draft) on every position (DistillSpec's simplest divergence)."""
    g = torch.Generator().manual_seed(seed)
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    bar = tqdm(range(steps), desc="distill draft", unit="step")
    for _ in bar:
        batch = token_rows[torch.randint(len(token_rows), (batch_size,), generator=g)]
        with torch.no_grad():
            p_log = target_model(batch).logits.float().log_softmax(-1)
        q_log = draft(batch).logits.float().log_softmax(-1)
        loss = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.set_postfix(kl=f"{loss.item():.3f}")
    return draft.eval()


def token_rows(tokenizer, files: list[Path], seq_len: int, max_rows: int) -> torch.Tensor:
    ids = []
    for f in files:
        ids += tokenizer(f.read_text(encoding="utf-8", errors="replace"))["input_ids"]
        if len(ids) >= seq_len * max_rows:
            break
    rows = len(ids) // seq_len
    return torch.tensor(ids[: rows * seq_len]).view(rows, seq_len)


def code_prompts(tokenizer, files: list[Path], count: int, prompt_tokens: int) -> list[list[int]]:
    """Prefixes starting a third of the way into each file, at a line start: mid-module code to continue."""
    prompts = []
    for f in files:
        lines = f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        ids = tokenizer("".join(lines[len(lines) // 3 :]))["input_ids"]
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="toy",
                        help="target folder, 'toy' (the shipped toy target) or a named target (smollm2-135m-instruct)")
    parser.add_argument("--draft-layers", type=int, default=3, help="0 = no draft LM (prompt lookup only)")
    parser.add_argument("--distill-steps", type=int, default=600)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (timings are steadier with 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-target", action="store_true",
                        help="also the rows with the target's verify forward compiled (a one-time compile per cache size)")
    parser.add_argument("--hf-compiled-assistant", action="store_true",
                        help="also time assisted generation with the assistant's forward torch.compile'd by hand "
                             "(its warm-up compiles for about a minute)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    # float32: greedy ties must break the same way in every method, so the token check is meaningful.
    path = resolve_target_path(args.target)
    target = FrozenTarget.from_pretrained(path, dtype="float32", device="cpu")
    model, tokenizer = target.model, AutoTokenizer.from_pretrained(path)
    files = stdlib_files(args.seed)
    prompt_files, distill_files = files[:200], files[200:]
    prompts = code_prompts(tokenizer, prompt_files, args.num_prompts, args.prompt_tokens)
    rows = token_rows(tokenizer, distill_files, seq_len=128, max_rows=2000) if args.draft_layers else None
    draft = None
    if args.draft_layers:
        draft = truncated_copy(model, args.draft_layers)
        draft = distill(draft, model, rows, args.distill_steps, batch_size=8, lr=2e-3, seed=args.seed)
        draft.requires_grad_(False)
        draft.generation_config.num_assistant_tokens = args.k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0  # 0 = off: always draft K
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    k, max_new = args.k, args.max_new_tokens

    def hf(ids, **kwargs):
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=pad, **kwargs)  # fmt: skip
        return out[0, len(ids) :].tolist(), []

    def ours(ids, source=None, compile_target=False):
        if source is None:
            return plain_decode(target, torch.tensor([ids]), max_new_tokens=max_new, eos_token_ids=eos).tokens, []
        out = speculative_decode(target, source, torch.tensor([ids]), k=k, max_new_tokens=max_new, eos_token_ids=eos,
                                 compile_target=compile_target)  # fmt: skip
        return out.tokens, out.steps

    methods = {"plain (specdraft)": lambda ids: ours(ids), "plain (HF generate)": lambda ids: hf(ids)}
    if args.compile_target:  # the like-for-like baseline of the rows whose target is compiled
        methods["plain (specdraft), target compiled"] = lambda ids: (plain_decode(
            target, torch.tensor([ids]), max_new_tokens=max_new, eos_token_ids=eos, compile_target=True).tokens, [])
    pairs = []  # (transformers' method, specdraft's counterpart)
    if draft is not None:
        pairs.append((f"HF assisted generation, draft LM (K={k})", f"specdraft, draft LM (K={k})"))
        methods[pairs[-1][0]] = lambda ids: hf(ids, assistant_model=draft)
        methods[pairs[-1][1]] = lambda ids: ours(ids, DraftLMSource(draft))
        # The same draft with its decode step compiled (torch.compile over a static cache); one source for all
        # prompts, so the warm-up below compiles it once. transformers turns compilation off for its assistant.
        compiled = DraftLMSource(draft, compile=True)
        pairs.append((pairs[-1][0], f"specdraft, draft LM compiled (K={k})"))
        methods[pairs[-1][1]] = lambda ids: ours(ids, compiled)
        if args.compile_target:
            pairs.append((pairs[-1][0], f"specdraft, draft LM and target verify compiled (K={k})"))
            methods[pairs[-1][1]] = lambda ids: ours(ids, compiled, compile_target=True)
        if args.hf_compiled_assistant:
            # What a transformers user can do by hand: compile the assistant's forward (dynamic shapes, since
            # its DynamicCache grows every step). A copy, so the other methods keep the eager draft.
            assistant = copy.deepcopy(draft)
            assistant.forward = torch.compile(assistant.forward, dynamic=True)
            pairs.append((f"HF assisted generation, assistant compiled by hand (K={k})", pairs[-1][1]))
            methods[pairs[-1][0]] = lambda ids: hf(ids, assistant_model=assistant)
    pairs.append((f"HF prompt lookup (K={k})", f"specdraft, prompt lookup (K={k})"))
    methods[pairs[-1][0]] = lambda ids: hf(ids, prompt_lookup_num_tokens=k, max_matching_ngram_size=3)
    methods[pairs[-1][1]] = lambda ids: ours(ids, PromptLookupSource(max_ngram=3))
    if args.compile_target:
        pairs.append((pairs[-1][0], f"specdraft, prompt lookup, target verify compiled (K={k})"))
        methods[pairs[-1][1]] = lambda ids: ours(ids, PromptLookupSource(max_ngram=3), compile_target=True)
    for fn in methods.values():  # warm-up
        fn(prompts[0][:16])

    # Interleave methods prompt by prompt, so machine noise hits all of them alike.
    tokens = {name: [] for name in methods}
    steps = {name: [] for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    for ids in tqdm(prompts, desc="decode", unit="prompt"):
        for name, fn in methods.items():
            start = time.perf_counter()
            out, step_stats = fn(ids)
            seconds[name] += time.perf_counter() - start
            tokens[name].append(out)
            steps[name] += step_stats

    names = list(methods)
    reference = tokens[names[1]]
    rate = {name: sum(map(len, tokens[name])) / seconds[name] for name in methods}
    plain_rate = rate[names[0]]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    drafted = (f"draft LM: its first {args.draft_layers} layers, distilled {args.distill_steps} steps"
               if draft is not None else "no draft LM (--draft-layers 0)")
    print(f"\ntarget {args.target} ({path}): {params:.1f}M params, {target.num_layers} layers; {drafted}; "
          f"{len(prompts)} prompts x {max_new} new tokens; greedy, float32, CPU, {args.threads} thread(s)\n")
    print(f"`python eval/bench_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    print("| method | tokens/s | speedup vs plain | identical to HF greedy | alpha | tau | c |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for name in methods:
        same = sum(a == b for a, b in zip(tokens[name], reference))
        s = steps[name]
        stats = (f"{measured_alpha(s):.3f} | {sum(x.num_accepted + 1 for x in s) / len(s):.2f} | "
                 f"{draft_cost_ratio(s):.3f}") if s else "- | - | -"  # fmt: skip
        print(f"| {name} | {rate[name]:.1f} | {rate[name] / plain_rate:.2f}x | {same}/{len(prompts)} | {stats} |")

    for hf_name, spec_name in pairs:
        s = steps[spec_name]
        alpha, c = measured_alpha(s), draft_cost_ratio(s)
        predicted = predicted_speedup(alpha, k, c)
        speedup = rate[spec_name] / plain_rate
        # The formula assumes a (K+1)-token verify forward costs what a 1-token forward does
        # (true on a memory-bound GPU); dividing by the measured ratio leaves the loop's own overhead.
        verify_cost = sum(x.target_seconds for x in s) / len(s) * plain_rate
        print(f"\n{spec_name}: {rate[spec_name] / rate[hf_name]:.2f}x the tokens/s of {hf_name}; "
              f"predicted speedup (1 - a^(K+1)) / ((1 - a)(1 + K c)) = {predicted:.2f}x, measured {speedup:.2f}x, "
              f"decoder efficiency {speedup / predicted:.2f}. One verify forward costs {verify_cost:.2f}x a plain "
              f"step here; counting that, the prediction is {predicted / verify_cost:.2f}x "
              f"(loop efficiency {speedup * verify_cost / predicted:.2f}).")
    if args.compile_target:
        compiled_plain = rate["plain (specdraft), target compiled"]
        print("\nWith the target compiled, against plain decoding with the target compiled too: " + ", ".join(
            f"{name} {rate[name] / compiled_plain:.2f}x" for name in methods if "target verify compiled" in name) + ".")
    all_identical = all(tokens[name] == reference for name in methods)
    if not all_identical:
        print("WARNING: methods disagree on some tokens (see the table)", file=sys.stderr)
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
