"""Tiny, download-free builders shared by the tests: a tokenizer and a Llama.

Import as ``from tiny import tiny_tokenizer, tiny_llama`` (not ``tests.tiny``):
``tests/`` is not a package, and pytest puts it on ``sys.path`` because it holds
the rootdir ``conftest.py`` (rootdir-conftest insertion, ``rootdir/tests``).

Everything is deterministic: the BPE is trained on a fixed corpus, the model
weights come from a fixed seed, so tests can pin expected values.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# A chat template with `{% generation %}` markers around each assistant answer, so
# `apply_chat_template(..., return_assistant_tokens_mask=True)` works. The answer's
# closing <|eos|> is inside the markers: the model must learn to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|eos|>{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The same rendering without markers: what most hub templates look like.
CHAT_TEMPLATE_NO_MARKERS = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a few tokens and the target verifies them in one forward.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea. The sea is wide, the sea is deep.",
    "How many legs does a spider have? A spider has eight legs.",
    "Hello! How can I help you today? Tell me a story about a cat.",
    "Once upon a time there was a cat who liked to sleep in the sun.",
    "1 + 1 = 2, 2 + 2 = 4, 3 + 3 = 6, 10 * 10 = 100.",
] * 4


@lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0..6, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 300, chat_template: str | None = CHAT_TEMPLATE):
    """Byte-level BPE (~``vocab_size`` tokens) as a transformers fast tokenizer.

    pad = ``<|pad|>`` (id 0), bos = ``<|bos|>`` (1), eos = ``<|eos|>`` (2). No
    BOS/EOS is added by ``tokenizer(text)``; the chat template adds the BOS.
    ``chat_template=None`` gives a tokenizer without one (for error tests);
    ``CHAT_TEMPLATE_NO_MARKERS`` one without ``{% generation %}`` markers.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_llama(vocab_size: int = 300, seed: int = 0, **overrides):
    """A 2-layer random Llama (hidden 64) in eval mode; ``overrides`` go to ``LlamaConfig``.
    Its weights come from ``seeded_init_``: the same under every transformers version."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)  # for anything the init draws that seeded_init_ then leaves alone (buffers)
    config = LlamaConfig(**kwargs)
    return seeded_init_(LlamaForCausalLM(config), seed, std=config.initializer_range).eval()


def save_tiny_target(path: str | Path, vocab_size: int = 300, **overrides) -> Path:
    """Write a tiny Llama + tokenizer folder loadable with ``from_pretrained(path)``."""
    path = Path(path)
    tokenizer = tiny_tokenizer(vocab_size)
    model = tiny_llama(len(tokenizer), **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def seeded_init_(module: torch.nn.Module, seed: int, std: float = 0.02, keep: tuple[str, ...] = ()) -> torch.nn.Module:
    """Redraw every parameter from a generator of its own, in place.

    transformers' ``_init_weights`` changes between versions (what it draws, and in what order),
    so a model built under ``torch.manual_seed`` is not the same model under another transformers.
    Pinned values must not hang on that: norm weights are set to 1, everything else is drawn
    N(0, std) here, which depends only on torch's generator. Parameters named in ``keep`` are
    left as built (a drafter's head copied from the target's rows, say).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():  # registration order: the model code's, not the init's
            if not param.is_floating_point() or name in keep:
                continue
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return module


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, what: str = ""):
    """|actual - expected| <= rel * (the largest magnitude compared), everywhere.

    float32 results computed with other shapes (a packed row against the document alone, a
    batched forward against a single one) differ in their reductions' order: about 1e-7 relative
    per operation, a few 1e-6 of the tensor's scale after a few layers. An elementwise rtol is
    wrong for that, because a value near 0 carries the rounding of the large values it was summed
    from; so the bound scales with the largest value. rel=1e-5 leaves a 3-10x margin over that
    rounding, while a real bug (a leak across documents, a wrong position) moves values by O(1)
    of the scale.
    """
    scale = max(actual.detach().abs().max().item(), expected.detach().abs().max().item(), 1e-30)
    error = (actual.detach() - expected.detach()).abs().max().item()
    assert error <= rel * scale, f"{what} max error {error:.3g} > {rel:g} x scale {scale:.3g}"
    return error / scale
