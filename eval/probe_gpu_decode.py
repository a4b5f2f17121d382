"""Probe: where a plain decode step's time goes on a GPU (the first GPU check measured plain decoding of the toy at
52 ms per token while Medusa-1's steps, on the same target, took 11 ms).

    python eval/probe_gpu_decode.py [--device cuda] [--tokens 96] [--profile]

For each of: transformers' own decode loop (DynamicCache, one token per forward), specdraft's plain_decode (eager,
and with CUDA graphs where transformers allows), and specdraft's prompt-lookup chain (K=5), three greedy decodes of one chat prompt, timed with the device synchronised;
the SM clock (NVML, when present) is sampled through each. Then, in bfloat16, plain decodes of one prompt against
prompts of new lengths (with cuDNN's attention allowed and, as specdraft decodes, off: a per-shape plan made a
first decode slow), and
one plain decode through evaluate(), as the eval runs it. --profile prints torch.profiler's top operators of one
plain decode, by CPU time and by device time. Prints a Markdown table: ms per target forward, and the median SM clock.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from transformers import DynamicCache

from specdraft import sdpa
from specdraft.decoding.sources import PromptLookupSource, static_cache_rolls_back
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.evaluation.run import EvalSettings, evaluate
from specdraft.evaluation.suites import Prompt, prompt_token_ids
from specdraft.target import FrozenTarget, resolve_target_path


class ClockSampler:
    """The SM clock in MHz every 5 ms while in a `with` block (NVML; empty without it)."""

    def __init__(self, device_index: int):
        self.samples: list[int] = []
        self.handle = None
        try:
            import pynvml  # nvidia-ml-py: optional, present on the GPU machines this probe was written for

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception:  # noqa: BLE001  no NVML: no clock column
            pass

    def __enter__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while self.handle is not None and not self.stop.is_set():
            self.samples.append(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def median(self) -> str:
        return f"{statistics.median(self.samples):.0f}" if self.samples else "-"


def hf_loop(target: FrozenTarget, ids: torch.Tensor, tokens: int) -> int:
    """transformers' model, one token per forward over a DynamicCache, greedy: the floor any decoder pays."""
    model = target.model
    cache = DynamicCache()
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(tokens - 1):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    target = FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="float32", device=device)
    ask = "Write a Python function that parses a date string in ISO format and returns the weekday name."
    ids = torch.tensor([prompt_token_ids(target.tokenizer, Prompt("0", "probe", "code", "question", [ask]))],
                       device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    methods = {
        "transformers loop (DynamicCache)": lambda: hf_loop(target, ids, args.tokens),
        "specdraft plain_decode": lambda: len(plain_decode(target, ids, max_new_tokens=args.tokens).forwards) + 1,
        "specdraft prompt lookup, K=5": lambda: len(speculative_decode(
            target, PromptLookupSource(max_ngram=3), ids, k=5, max_new_tokens=args.tokens).forwards) + 1,
    }
    if device.type == "cuda" and static_cache_rolls_back():
        methods["specdraft plain_decode, CUDA graphs"] = lambda: len(plain_decode(
            target, ids, max_new_tokens=args.tokens, compile_target="reduce-overhead").forwards) + 1
    rows = []
    for name, fn in methods.items():
        fn()  # warm-up
        times, forwards, clocks = [], [], ClockSampler(device.index or 0)
        with clocks:
            for _ in range(3):
                sync()
                start = time.perf_counter()
                result = fn()
                sync()
                times.append(time.perf_counter() - start)
                forwards.append(result)
        ms = statistics.median(t / f * 1e3 for t, f in zip(times, forwards))
        rows.append(f"| {name} | {statistics.median(forwards)} | {ms:.2f} | {clocks.median()} |")
        print(rows[-1], flush=True)

    # The GPU check's eval decoded in bfloat16, each prompt and method meeting new (query, key) lengths. A backend
    # that plans per shape (cuDNN's attention) pays that per step the first time: plain decoding, first on every
    # prompt, would pay it all. bf16, three runs of one prompt (shapes seen) against three prompts of new lengths
    # (shapes new), with cuDNN's attention allowed (as specdraft decoded before specdraft/sdpa.py), then the new
    # lengths again as specdraft decodes now, with cuDNN's attention off.
    bf16 = FrozenTarget.from_pretrained(resolve_target_path("toy"), dtype="bfloat16", device=device)
    fresh = iter(range(1, 1000))

    def new_lengths() -> torch.Tensor:  # the ask behind a preamble of a length no run used yet
        preamble = " ".join(["Please."] * next(fresh))
        return torch.tensor([prompt_token_ids(bf16.tokenizer, Prompt("0", "probe", "code", "question",
                                                                      [f"{preamble} {ask}"]))], device=device)

    bf16_runs = {"bf16 plain_decode, one prompt (shapes seen), cuDNN attention allowed": lambda: ids,
                 "bf16 plain_decode, a new prompt length each run (shapes new), cuDNN attention allowed": new_lengths}
    if device.type == "cuda":
        bf16_runs["bf16 plain_decode, new lengths, cuDNN attention off (as specdraft decodes)"] = new_lengths
    decoders_own = sdpa.CUDNN_ATTENTION_DEVICE_TYPES
    for name, make_ids in bf16_runs.items():
        allowed = "cuDNN attention allowed" in name
        sdpa.CUDNN_ATTENTION_DEVICE_TYPES = () if allowed else decoders_own  # the decoder's own switch, lifted
        torch.backends.cuda.enable_cudnn_sdp(allowed)
        plain_decode(bf16, ids, max_new_tokens=args.tokens)  # warm-up (the first prompt's shapes)
        times = []
        for _ in range(3):
            run_ids = make_ids()
            sync()
            start = time.perf_counter()
            out = plain_decode(bf16, run_ids, max_new_tokens=args.tokens)
            sync()
            times.append((time.perf_counter() - start) / (len(out.forwards) + 1))
        rows.append(f"| {name} | {len(out.forwards) + 1} | {statistics.median(times) * 1e3:.2f} | - |")
        print(rows[-1], flush=True)
    sdpa.CUDNN_ATTENTION_DEVICE_TYPES = decoders_own
    torch.backends.cuda.enable_cudnn_sdp(True)

    # The same plain decode through evaluate(), which the GPU check's eval used (it stops at the end of turn, so
    # its token count can be lower): its own clock per token, and the wall clock around the whole call.
    prompt = Prompt("0", "probe", "code", "question", [ask])
    settings = EvalSettings(max_new_tokens=args.tokens, forward_costs=False, show_progress=False)
    sync()
    start = time.perf_counter()
    overall = evaluate(target, {}, [prompt], settings)["methods"]["plain"]["overall"]
    sync()
    wall = time.perf_counter() - start
    rows.append(f"| evaluate(), plain only: its own clock | {overall['num_tokens']} | "
                f"{overall['seconds'] / overall['num_tokens'] * 1e3:.2f} | - |")
    rows.append(f"| evaluate(), plain only: the whole call (its warm-up included) | {overall['num_tokens']} | "
                f"{wall / overall['num_tokens'] * 1e3:.2f} | - |")
    print("\n".join(rows[-2:]), flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            plain_decode(target, ids, max_new_tokens=32)
            sync()
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=25))
        if device.type == "cuda":
            print(table.table(sort_by="self_cuda_time_total", row_limit=15))

    print(f"\n`python eval/probe_gpu_decode.py --device {args.device} --tokens {args.tokens}`: toy target, float32 (bf16 where named), "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}\n")
    print("| decode | target forwards (prefill included) | ms per forward (median of 3) | SM clock MHz (median) |\n|---|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
