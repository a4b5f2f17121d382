"""cuDNN's attention off in specdraft's CUDA work (specdraft/sdpa.py): the context itself, and that decoding,
answer generation and training run every target forward inside it.

A CPU cannot run cuDNN, but torch's SDPA backend flags exist on every build, so the wiring is checked on the
CPU by letting the context act on CPU devices too (``CUDNN_ATTENTION_DEVICE_TYPES``) and reading the flags
from inside the target's forward."""

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
import torch
from spine import make_chat_data, make_recipe
from tiny import save_tiny_target, tiny_llama, tiny_tokenizer

from specdraft import sdpa
from specdraft.config import parse_recipe
from specdraft.data.regenerate import generate_batch
from specdraft.decoding.sources import PromptLookupSource
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.sdpa import cudnn_attention_off
from specdraft.target import FrozenTarget
from specdraft.train import train

FLAGS = {
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
}


def flags() -> dict[str, bool]:
    return {name: read() for name, (read, _) in FLAGS.items()}


@pytest.fixture
def all_backends_on():
    """Every SDPA backend on (torch's default) for the test, and the process's flags as they were after it."""
    before = flags()
    for _, enable in FLAGS.values():
        enable(True)
    yield
    for name, (_, enable) in FLAGS.items():
        enable(before[name])


@pytest.fixture
def on_cpu_too(monkeypatch, all_backends_on):
    monkeypatch.setattr(sdpa, "CUDNN_ATTENTION_DEVICE_TYPES", ("cuda", "cpu"))


def test_on_cuda_only_cudnn_attention_is_off_and_the_callers_flags_come_back(all_backends_on):
    torch.backends.cuda.enable_math_sdp(False)  # a caller's own choice: kept inside, and after
    caller = flags()
    with cudnn_attention_off(torch.device("cuda", 0)):
        assert flags() == {"cudnn": False, "flash": True, "efficient": True, "math": False}
    assert flags() == caller
    torch.backends.cuda.enable_cudnn_sdp(False)  # a caller who had turned it off already keeps it off
    with cudnn_attention_off("cuda"):
        assert not flags()["cudnn"]
    assert not flags()["cudnn"]


def test_the_callers_flag_comes_back_when_the_work_fails(all_backends_on):
    with pytest.raises(RuntimeError, match="boom"), cudnn_attention_off("cuda"):
        raise RuntimeError("boom")
    assert flags()["cudnn"]


def test_on_other_devices_nothing_changes(all_backends_on):
    for device in ("cpu", torch.device("meta")):
        with cudnn_attention_off(device):
            assert flags() == {"cudnn": True, "flash": True, "efficient": True, "math": True}


def recording(monkeypatch, owner, name: str) -> list[bool]:
    """Record, at each call of ``owner.name``, whether cuDNN's attention was on."""
    seen, original = [], getattr(owner, name)

    def wrapped(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return seen


def test_decoding_runs_every_target_forward_with_cudnn_attention_off(monkeypatch, on_cpu_too):
    target = FrozenTarget(tiny_llama(64, seed=0))
    seen = recording(monkeypatch, FrozenTarget, "forward")
    prompt = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 2]])
    plain_decode(target, prompt, max_new_tokens=6)
    speculative_decode(target, PromptLookupSource(), prompt, k=3, max_new_tokens=6)
    assert len(seen) >= 4 and not any(seen), seen
    assert flags()["cudnn"]  # restored after the decode


def test_answer_generation_runs_with_cudnn_attention_off(monkeypatch, on_cpu_too):
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer))
    seen = recording(monkeypatch, model, "forward")
    generate_batch(model, tokenizer, ["a question", "another, longer question"], temperature=0.0, max_new_tokens=4)
    assert len(seen) >= 4 and not any(seen), seen
    assert flags()["cudnn"]


def test_training_runs_every_target_forward_with_cudnn_attention_off(monkeypatch, on_cpu_too, tmp_path):
    seen = recording(monkeypatch, FrozenTarget, "forward_batch")
    target = save_tiny_target(tmp_path / "target")
    data = make_chat_data(tmp_path / "chat.jsonl", n=16)
    train(parse_recipe(make_recipe(tmp_path, target, data, training={"max_steps": 2, "grad_accumulation": 1})),
          show_progress=False)
    assert len(seen) >= 2 and not any(seen), seen
    assert flags()["cudnn"]
