"""Greedy mismatches are located and judged: a near-tie within the dtype's rounding, or a defect."""

import pytest
import torch
from tiny import tiny_llama, tiny_tokenizer

from specdraft.decoding import speculative
from specdraft.decoding.sources import PromptLookupSource
from specdraft.decoding.speculative import plain_decode
from specdraft.evaluation import mismatch, report
from specdraft.evaluation import run as eval_run
from specdraft.evaluation.suites import Prompt
from specdraft.target import FrozenTarget

PROMPTS = [Prompt("1", "bench", "qa", "question", ["What is the capital of France?"]),
           Prompt("2", "bench", "story", "question", ["Tell me a story about a cat."])]


@pytest.fixture(scope="module")
def target():
    tokenizer = tiny_tokenizer()
    return FrozenTarget(tiny_llama(len(tokenizer), seed=0), tokenizer=tokenizer)


def greedy(target, prompt, n=12):
    return plain_decode(target, torch.tensor([prompt]), max_new_tokens=n).tokens


def test_first_difference():
    assert mismatch.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert mismatch.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert mismatch.first_difference([1, 2, 3], [1, 2]) == 2  # stopped early


def test_the_two_computations_agree_to_float32_rounding(target):
    prompt = [1, 40, 41, 42, 43, 44]
    one, verify = mismatch.one_token_and_verify_logits(target, prompt, [50, 51, 52, 53])
    assert (one - verify).abs().max().item() <= mismatch.rounding_bound(one, torch.float32)
    # and the 1-token computation is plain decoding's: its argmax is plain decoding's next token
    assert one.argmax().item() == greedy(target, prompt, 1)[0]


def test_a_wrong_token_is_a_defect(target):
    prompt = [1, 40, 41, 42, 43, 44]
    reference = greedy(target, prompt)
    other = reference[:5] + [(reference[5] + 1) % 300] + reference[6:]
    found = mismatch.explain(target, prompt, reference, other, k=4)
    assert found["position"] == 5 and found["verdict"] == "defect"
    assert found["one_token"]["gap"] > found["rounding_bound"]
    assert found["one_token"]["tokens"][0] == reference[5]


def test_an_exact_tie_is_rounding():
    """Two tokens with identical LM-head rows tie at every position: either choice is the target's."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0)
    target = FrozenTarget(model, tokenizer=tokenizer)
    prompt = [1, 40, 41, 42, 43, 44]
    first = greedy(target, prompt, 1)[0]
    twin = (first + 7) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[first]
    reference = greedy(target, prompt, 4)
    assert reference[0] == min(first, twin)  # argmax takes the first of a tie
    other = [max(first, twin)] + reference[1:]
    found = mismatch.explain(target, prompt, reference, other, k=3)
    assert found["verdict"] == "rounding" and found["one_token"]["gap"] == 0.0


def test_evaluate_reports_and_prints_a_defect(target, monkeypatch):
    """A decoder that emits a wrong token is caught by the eval, located and printed as a DEFECT."""
    real = speculative.speculative_decode_batch

    def broken(target, sources, *args, **kwargs):
        outs = real(target, sources, *args, **kwargs)
        for out in outs if sources is not None else ():  # the drafted methods; plain decoding stays right
            out.tokens[3] = (out.tokens[3] + 1) % 300
        return outs

    monkeypatch.setattr(eval_run, "speculative_decode_batch", broken)
    result = eval_run.evaluate(target, {"lookup": PromptLookupSource}, PROMPTS,
                               eval_run.EvalSettings(k=3, max_new_tokens=10, show_progress=False))
    assert result["greedy_identical"] == {"lookup": 0.0}
    found = result["greedy_mismatches"]["lookup"]
    assert [(m["prompt"], m["position"], m["verdict"]) for m in found] == [("bench/1", 3, "defect"),
                                                                          ("bench/2", 3, "defect")]
    notes = report.format_table(result)
    assert "lookup: 2 greedy decode(s) differ from plain decoding (2 defect)" in notes
    assert "DEFECT: lookup on bench/1 differs at token 3" in notes


def test_a_correct_decoder_has_no_mismatches(target):
    result = eval_run.evaluate(target, {"lookup": PromptLookupSource}, PROMPTS,
                               eval_run.EvalSettings(k=3, max_new_tokens=10, show_progress=False))
    assert result["greedy_identical"] == {"lookup": 1.0} and result["greedy_mismatches"] == {"lookup": []}
