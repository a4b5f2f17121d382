"""Compile every verify kernel ahead of time for real GPUs, at the signatures the launchers produce.

    TRITON_INTERPRET=0 python eval/compile_kernels.py            # sm_80 and sm_90, a table
    TRITON_INTERPRET=0 python eval/compile_kernels.py --json F   # and the rows as JSON

No GPU is needed: triton's wheel ships ptxas (triton 3.9 builds sm_90 with its ptxas-blackwell, 3.6 with
ptxas; it picks the right one itself). The interpreter accepts what a GPU build may refuse, so this is the check that
the kernels really build. The signatures are not written by hand: each launcher
(``rejection_sample``, ``tree_sample``) runs on CPU tensors with its kernels replaced by recorders,
for fp32, bf16 and fp16 probabilities, with and without draft probs, at V = 100 (one chunk),
32001 (rows not 16-aligned) and 152064; the recorded arguments go through triton's own JIT binder
(the code ``kernel[grid](...)`` runs) to get the signature, constants and specialisations a launch
on that GPU would compile. Each distinct one is compiled once per arch.

Checked per compiled kernel (``problems``): division only as IEEE ``div.rn`` (no div.full / div.approx,
so the GPU rounds as torch does), no fma contraction, no local memory (no ``.local`` in the PTX) and
ptxas reporting 0 bytes of stack frame and of spill stores and loads. Prints registers per kernel.
Run with TRITON_INTERPRET=0 (kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time

import torch

from specdraft.decoding.tree_verify import mass_scale_bits

ARCHS = (80, 90)
VOCABS = (100, 32001, 152064)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the launch and runs nothing."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def capture_launches() -> list[tuple[object, tuple, dict]]:
    """(kernel, args, kwargs) of every launch the two launchers make over the cases above."""
    from specdraft.kernels import rejection_sampler, tree_sampler

    names = {rejection_sampler: ("rejection_partials_kernel", "rejection_combine_kernel"),
             tree_sampler: ("tree_partials_kernel", "tree_combine_kernel")}  # fmt: skip
    recorders = []
    for module, kernels in names.items():
        for name in kernels:
            recorders.append((module, name, _Recorder(getattr(module, name))))
            setattr(module, name, recorders[-1][2])
    try:
        for dtype in DTYPES:
            for vocab in VOCABS:
                for with_q in (False, True):
                    _launch_chain(rejection_sampler.rejection_sample, dtype, vocab, with_q)
                    _launch_tree(tree_sampler.tree_sample, dtype, vocab, with_q)
    finally:
        for module, name, recorder in recorders:
            setattr(module, name, recorder.kernel)
    return [(r.kernel, args, kwargs) for _, _, r in recorders for args, kwargs in r.launches]


def _launch_chain(rejection_sample, dtype, vocab: int, with_q: bool) -> None:
    """The chain launcher as the decoders call it: rows of 3 and 0 drafts (K = 3), plus a K = 0 step."""
    for counts, k in (([3, 0], 3), ([0], 0)):
        num_tokens = sum(counts)
        p = torch.rand(num_tokens, vocab).softmax(-1).to(dtype)
        rejection_sample(
            torch.zeros(num_tokens, dtype=torch.long), torch.tensor(counts).cumsum(0),
            p.clone() if with_q else None, p, torch.zeros(len(counts), dtype=torch.long), torch.rand(num_tokens),
            torch.ones(len(counts), vocab), torch.zeros(len(counts), dtype=torch.bool), max_spec_len=k,
        )  # fmt: skip


def _launch_tree(tree_sample, dtype, vocab: int, with_q: bool) -> None:
    """The tree launcher: a row of a 3-node tree and a row of none."""
    parents = torch.tensor([-1, 0, -1])
    p = torch.rand(len(parents) + 2, vocab).softmax(-1).to(dtype)
    tree_sample(
        torch.zeros(3, dtype=torch.long), parents, torch.tensor([3, 3]),
        torch.rand(3, vocab).to(dtype) if with_q else None, p, torch.rand(3), torch.ones(2, vocab),
        torch.zeros(2, dtype=torch.bool), max_depth=2, mass_bits=mass_scale_bits(vocab),
    )  # fmt: skip


def specialize(kernel, args: tuple, kwargs: dict, arch: int) -> dict:
    """What ``kernel[grid](*args, **kwargs)`` would compile on sm_<arch>: triton's JIT binder specialises
    the arguments (dtypes, 16-alignment, ints equal to 1) as a real launch does."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # JITFunction.run adds `debug` (and, depending on the triton version, other knobs whose defaults are the
    # options' own defaults) before binding.
    kwargs = {**kwargs, "debug": kernel.debug or knobs.runtime.debug}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return dict(kernel=kernel, target=target, signature=signature, constexprs=constexprs, attrs=attrs,
                options=options, key=(kernel.__name__, arch, repr(signature), repr(constexprs), repr(attrs),
                                      repr(options)))  # fmt: skip


def compile_spec(spec: dict):
    """(compiled kernel, ptxas -v log) for one ``specialize`` result: PTX and a cubin, no GPU."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v (registers, stack, spills) goes to stdout
    knobs.compilation.always_compile = True  # a cached binary would skip ptxas, and its report
    with contextlib.redirect_stdout(log):
        source = ASTSource(spec["kernel"], spec["signature"], spec["constexprs"], spec["attrs"])
        compiled = triton.compile(source, target=spec["target"], options=spec["options"].__dict__)
    return compiled, log.getvalue()


def ptxas_usage(log: str) -> dict:
    """Registers, stack frame and spill bytes from ptxas -v."""
    usage = {"registers": int(re.search(r"Used (\d+) registers", log).group(1))}
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    usage.update(stack_bytes=int(frame.group(1)), spill_store_bytes=int(frame.group(2)),
                 spill_load_bytes=int(frame.group(3)))  # fmt: skip
    return usage


def problems(ptx: str, usage: dict, divides: bool) -> list[str]:
    """What would make this binary differ from the reference or run slowly: empty when all is well."""
    found = []
    if "div.full" in ptx or "div.approx" in ptx:
        found.append("approximate division (div.full / div.approx): rounds unlike torch's `/`")
    if divides and "div.rn.f32" not in ptx:
        found.append("no div.rn.f32 where the race divides")
    if "fma.rn.f32" in ptx:
        found.append("fma contraction changes float32 rounding")
    if re.search(r"\.local\b", ptx):
        found.append("local memory in the PTX")
    for name in ("stack_bytes", "spill_store_bytes", "spill_load_bytes"):
        if usage[name]:
            found.append(f"ptxas: {usage[name]} {name.replace('_', ' ')}")
    return found


def describe(spec: dict) -> str:
    """The parts of a specialisation that vary: probability dtypes, constexprs, 16-divisible ints."""
    names = list(spec["signature"])
    parts = [f"{name.removesuffix('_ptr')}={spec['signature'][name]}" for name in ("target_probs_ptr", "draft_probs_ptr")
             if name in spec["signature"]]  # fmt: skip
    parts += [f"{names[path[0]]}={value}" for path, value in spec["constexprs"].items()
              if names[path[0]] not in ("BLOCK_S", "BLOCK_OUT")]  # fmt: skip
    parts += [f"{names[path[0]]}%16" for path, attrs in spec["attrs"].items()
              if attrs and not spec["signature"][names[path[0]]].startswith("*")]  # fmt: skip
    return " ".join(parts)


def compile_all(archs=ARCHS) -> list[dict]:
    """One row per distinct (kernel, arch, specialisation): its registers, spills and problems."""
    rows, seen = [], set()
    for kernel, args, kwargs in capture_launches():
        for arch in archs:
            spec = specialize(kernel, args, kwargs, arch)
            if spec["key"] in seen:
                continue
            seen.add(spec["key"])
            start = time.perf_counter()
            compiled, log = compile_spec(spec)
            usage = ptxas_usage(log)
            rows.append({"kernel": kernel.__name__, "arch": f"sm_{arch}",
                         "variant": describe(spec), **usage,
                         "seconds": round(time.perf_counter() - start, 2),
                         "problems": problems(compiled.asm["ptx"], usage, divides="partials" in kernel.__name__)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows here")
    parser.add_argument("--arch", type=int, action="append", default=None, help="80, 90 (default both)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled")
    rows = compile_all(tuple(args.arch or ARCHS))
    print(f"{'kernel':<26} {'arch':<6} {'regs':>4} {'stack':>5} {'spill st/ld':>11}  variant")
    for r in rows:
        print(f"{r['kernel']:<26} {r['arch']:<6} {r['registers']:>4} {r['stack_bytes']:>5} "
              f"{r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<5}  {r['variant']}"
              + ("" if not r["problems"] else "  PROBLEMS: " + "; ".join(r["problems"])))
    print(f"{len(rows)} compiles, {sum(r['seconds'] for r in rows):.1f} s; "
          f"{sum(bool(r['problems']) for r in rows)} with problems")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
