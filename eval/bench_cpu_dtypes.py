"""Benchmark: what bf16 and fp16 cost on this CPU against float32, and whether specdraft calls them native.

specdraft warns (training, `specdraft regenerate`) and the quickstart falls back to float32 when the CPU has
no hardware for a half precision (specdraft.dtypes.cpu_computes_natively: oneDNN's own check). This measures
what that fallback avoids, one thread:

  1. matmul     the target's MLP up-projection shape ([tokens, hidden] x [hidden, intermediate]), per dtype
  2. generate   greedy generation of NEW tokens for a batch of chat prompts, per dtype (the target's answers)
  3. train      forward and backward of the target on [4, TOKENS] tokens under torch.autocast in the dtype
                (what training.mixed_precision does), float32 weights; float32 is autocast off

  python eval/bench_cpu_dtypes.py --target smollm2-135m-instruct
  python eval/bench_cpu_dtypes.py --target toy
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdraft.dtypes import DTYPES, cpu_computes_natively
from specdraft.target import resolve_target_path

PROMPTS = ["Explain why the sky is blue in two sentences.", "Write a Python function that reverses a string.",
           "List three uses of a paperclip.", "How do I boil an egg?"]


def seconds(work, repeats: int) -> float:
    work()  # warm-up: first-call allocation and kernel choice
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def matmul_seconds(config, dtype: torch.dtype, tokens: int, repeats: int) -> float:
    a = torch.randn(tokens, config.hidden_size, dtype=dtype)
    b = torch.randn(config.hidden_size, config.intermediate_size, dtype=dtype)
    return seconds(lambda: a @ b, repeats)


def generate_seconds(target_dir: str, dtype: torch.dtype, new_tokens: int, repeats: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in PROMPTS]
    batch = tokenizer(texts, return_tensors="pt", padding=True)

    def work():
        with torch.inference_mode():
            model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return seconds(work, repeats)


def train_step_seconds(target_dir: str, dtype: torch.dtype, tokens: int, repeats: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).train()
    ids = torch.randint(0, model.config.vocab_size, (4, tokens), generator=torch.Generator().manual_seed(0))

    def work():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    return seconds(work, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="toy")
    parser.add_argument("--tokens", type=int, default=256, help="rows of the matmul (a micro-batch's tokens)")
    parser.add_argument("--new-tokens", type=int, default=32, help="generated per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target_dir = resolve_target_path(args.target, "float32")
    config = AutoConfig.from_pretrained(target_dir)
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"## Half precision on this CPU ({args.target}; torch {torch.__version__}, CPU capability {capability}, "
          "1 thread)\n")
    print(f"`python eval/bench_cpu_dtypes.py {' '.join(sys.argv[1:])}`\n")
    print(f"| dtype | native (cpu_computes_natively) | matmul {args.tokens}x{config.hidden_size}x"
          f"{config.intermediate_size} ms | x float32 | generate {len(PROMPTS)} x {args.new_tokens} tokens s | "
          f"x float32 | train step 4 x {args.tokens} s | x float32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    base = {}
    for name in ("float32", "bfloat16", "float16"):  # float32 first: the others are compared with it
        dtype = DTYPES[name]
        mm = matmul_seconds(config, dtype, args.tokens, args.repeats)
        gen = generate_seconds(target_dir, dtype, args.new_tokens, args.repeats)
        step = train_step_seconds(target_dir, dtype, args.tokens, args.repeats)
        base = base or {"mm": mm, "gen": gen, "step": step}
        print(f"| {name} | {'yes' if cpu_computes_natively(name) else 'no'} | {mm * 1e3:.2f} | "
              f"{mm / base['mm']:.1f} | {gen:.2f} | {gen / base['gen']:.1f} | {step:.2f} | "
              f"{step / base['step']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
