"""Medusa-1 heads (Cai et al. 2024, arXiv 2401.10774): architecture, label offsets, loss, decoding,
export to the engines that serve it, bad input, and a `specdraft train` run resumed after kill -9.

The engines are not installed here, so ``fasterdecoding_loads`` and ``vllm_loads`` re-implement what
each does with an exported folder, from the files named in their docstrings: they parse the config
the engine's way, build its parameter table, route every tensor as its loader does, require every
parameter to be filled with the right shape, and return the weights the engine would run.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file
from tiny import assert_close, seeded_init_
from transformers import AutoConfig, LlamaConfig

from specdraft.config import parse_recipe
from specdraft.contract import Drafter, TargetNeeds, TargetOutputs, TrainingContext
from specdraft.data.vocab import DraftVocab
from specdraft.decoding.sampling import SamplingParams, logits_to_probs
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.drafters import FAMILIES, load_drafter
from specdraft.drafters.medusa import (
    MEDUSA1,
    MedusaConfig,
    head_weights,
    medusa_loss,
    medusa_lr_schedule,
    predicted_positions,
)
from specdraft.errors import SpecdraftError
from specdraft.export import export, load_exported
from specdraft.target import FrozenTarget

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0)
CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 256, "tie_word_embeddings": False}


def tiny_target(seed: int = 0, std: float = 0.3, **overrides) -> FrozenTarget:
    """A 2-layer Llama whose weights come from seeded_init_ (std 0.3: peaked next-token distributions)."""
    config = LlamaConfig(**{**CONFIG, **overrides})
    config.architectures = ["LlamaForCausalLM"]
    target = FrozenTarget.from_config(config, device="cpu")
    seeded_init_(target.model, seed=seed, std=std)
    return target


def build(target, vocab_ids=None, randomize=True, **cfg) -> torch.nn.Module:
    """Medusa heads on ``target``; ``vocab_ids``: a reduced draft vocabulary of these target ids.
    ``randomize``: every trained tensor redrawn (ResBlocks too), so a dropped or swapped one shows."""
    vocab = None if vocab_ids is None else DraftVocab.from_target_ids(torch.as_tensor(vocab_ids), VOCAB)
    if vocab is not None:
        cfg["draft_vocab_size"] = vocab.size
    drafter = MEDUSA1.build(target, MedusaConfig(**cfg), vocab)
    return seeded_init_(drafter, seed=1, std=0.2) if randomize else drafter


def random_ids(*shape, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def chat_batch(seed: int = 1) -> dict:
    """Two rows: the first with a 5-token prompt (loss_mask 0) and a 15-token answer, the second
    right-padded after 13 tokens: the masks the loss must respect."""
    ids = random_ids(2, 20, seed=seed)
    attention = torch.ones(2, 20, dtype=torch.long)
    attention[1, 13:] = 0
    loss_mask = attention.clone()
    loss_mask[0, :5] = 0
    loss_mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def packed_batch(seed: int = 2) -> dict:
    """One row holding two documents (10 + 12 tokens), block-causal."""
    ids = random_ids(1, 22, seed=seed)
    seq_ids = torch.tensor([[0] * 10 + [1] * 12])
    ones = torch.ones(1, 22, dtype=torch.long)
    positions = torch.cat([torch.arange(10), torch.arange(12)])[None]
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.clone(), "seq_ids": seq_ids,
            "position_ids": positions}


def target_outputs(target, batch, logits="full") -> TargetOutputs:
    return target.forward_batch(batch, logits)


def in_target_vocab(drafter, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary logits at their target ids, -inf elsewhere."""
    if drafter.draft_ids is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], VOCAB), float("-inf"))
    out[..., drafter.draft_ids] = logits
    return out


# -- the family and its heads ------------------------------------------------------------------------


def test_the_family_is_registered_and_fills_the_contract():
    assert FAMILIES["medusa1"] is MEDUSA1 and MEDUSA1.needs_draft_vocab
    assert set(MEDUSA1.exporters) == {"medusa", "vllm", "hf"}
    target = tiny_target()
    drafter = build(target)
    assert isinstance(drafter, Drafter) and drafter.trained_module() is drafter
    assert target.needs.final_hidden  # building made the target compute what the heads read


def test_needs_are_declared_from_the_target_config_alone():
    config = LlamaConfig(**CONFIG)
    assert MEDUSA1.needs(MedusaConfig(), config) == TargetNeeds(final_hidden=True)  # hard labels: no logits
    assert MEDUSA1.needs(MedusaConfig(distill=True), config) == TargetNeeds(logits="full", final_hidden=True)
    reduced = MedusaConfig(distill=True, draft_vocab_size=100)
    assert MEDUSA1.needs(reduced, config) == TargetNeeds(logits="draft_rows", final_hidden=True)


def test_each_head_has_distinct_resblocks_and_the_papers_parameter_count():
    """The reference repeats one ResBlock module num_layers times (shared weights); here each layer is
    its own: changing one layer's weight leaves the others, and a head's output depends on all of them."""
    target = tiny_target()
    drafter = build(target, num_heads=3, num_layers=3, randomize=False)
    H = CONFIG["hidden_size"]
    blocks = drafter.heads[0].resblocks
    assert len({b.linear.weight.data_ptr() for b in blocks}) == 3
    assert len({id(p) for p in drafter.parameters()}) == len(drafter.state_dict()) == 3 * (3 * 2 + 1)
    assert sum(p.numel() for p in drafter.parameters()) == 3 * (3 * (H * H + H) + VOCAB * H)
    hidden = torch.randn(4, H, generator=torch.Generator().manual_seed(0))
    before = drafter.head_logits(hidden)
    with torch.no_grad():
        blocks[1].linear.weight.fill_(0.01)
    assert torch.count_nonzero(blocks[0].linear.weight) == 0 and torch.count_nonzero(blocks[2].linear.weight) == 0
    after = drafter.head_logits(hidden)
    assert not torch.equal(after[:, 0], before[:, 0]) and torch.equal(after[:, 1:], before[:, 1:])


@pytest.mark.parametrize("reduced", [False, True])
def test_each_head_starts_as_the_targets_lm_head_on_the_last_hidden_state(reduced):
    """W1 = 0 and b1 = 0 make every ResBlock the identity, and W2 is the target's head (its draft rows):
    before training, every head's logits at position t are the target's logits at t."""
    target = tiny_target()
    keep = torch.arange(0, VOCAB, 3) if reduced else None
    drafter = build(target, vocab_ids=keep, randomize=False, num_heads=4, num_layers=2)
    ids = random_ids(2, 12, seed=3)
    out = target(ids)
    heads = drafter.head_logits(out.final_hidden)  # [B, T, K, N]
    expected = out.logits if keep is None else out.logits[..., keep]
    for k in range(4):
        assert torch.equal(heads[:, :, k], expected)


# -- labels and loss -----------------------------------------------------------------------------------


def test_head_k_predicts_token_t_plus_k_plus_2():
    """Hidden state t is the unit vector e_t, every ResBlock the identity, and head k's LM head maps e_t
    to token ids[t+k+2]: then every head is right everywhere, and would be right nowhere if the labels
    were one token off."""
    T, K = 24, 3
    target = tiny_target(hidden_size=64)
    drafter = build(target, randomize=False, num_heads=K)
    ids = random_ids(1, T, seed=4)
    hidden = torch.eye(64)[:T][None]  # [1, T, H]
    with torch.no_grad():
        for k, head in enumerate(drafter.heads):
            head.lm_head.weight.zero_()
            for t in range(T - k - 2):
                head.lm_head.weight[ids[0, t + k + 2], t] = 30.0
    batch = {"input_ids": ids, "attention_mask": torch.ones(1, T), "loss_mask": torch.ones(1, T)}
    out = drafter.compute_loss(batch, TargetOutputs(final_hidden=hidden))
    for k in range(K):
        assert out.metrics[f"acc_{k}"] == 1.0 and out.metrics[f"loss_{k}"] < 1e-6
    assert out.metrics["sim_accept_len"] == K
    shifted = {**batch, "input_ids": torch.roll(ids, 1, dims=1)}  # every label one place later
    assert all(drafter.compute_loss(shifted, TargetOutputs(final_hidden=hidden)).metrics[f"acc_{k}"] < 0.2
               for k in range(K))


def brute_force_loss(drafter, batch, target_out, distill: bool, decay: float = 0.8) -> torch.Tensor:
    """sum_k decay^k mean_t CE(label_{t+k+2}, head_k(h_t)), position by position, written out from the
    paper's formula with the heads' raw parameters: ResBlock x + SiLU(W x + b), then W2."""
    ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    seq_ids = batch.get("seq_ids")
    B, T = ids.shape
    total = torch.zeros(())
    for k, head in enumerate(drafter.heads):
        terms = []
        for b in range(B):
            for t in range(T - k - 2):
                y = t + k + 2
                if not (loss_mask[b, y] and attention[b, t] and attention[b, y]):
                    continue
                if seq_ids is not None and seq_ids[b, t] != seq_ids[b, y]:
                    continue
                x = target_out.final_hidden[b, t].float()
                for block in head.resblocks:
                    x = x + F.silu(block.linear.weight @ x + block.linear.bias)
                log_q = torch.log_softmax(head.lm_head.weight @ x, -1)
                if distill:  # the target's p(token y | x_<y): its logits at y - 1
                    terms.append(-(torch.softmax(target_out.logits[b, y - 1].float(), -1) * log_q).sum())
                else:
                    terms.append(-log_q[ids[b, y]])
        total = total + decay**k * torch.stack(terms).mean()
    return total


@pytest.mark.parametrize("make_batch", [chat_batch, packed_batch], ids=["padded", "packed"])
@pytest.mark.parametrize("distill", [False, True], ids=["hard", "distill"])
def test_loss_is_the_papers_weighted_sum_of_head_cross_entropies(make_batch, distill):
    target = tiny_target()
    drafter = build(target, num_heads=3, num_layers=2, distill=distill)
    batch = make_batch()
    target_out = drafter.prepare(batch, TrainingContext(target)).target
    assert (target_out.logits is not None) == distill
    out = drafter.compute_loss(batch, target_out)
    assert_close(out.loss, brute_force_loss(drafter, batch, target_outputs(target, batch), distill), rel=1e-5)


def test_initial_losses_are_pinned():
    """The padded batch on the seeded target, heads with seeded ResBlocks and the target's LM head:
    hard labels and soft (distill) labels."""
    target = tiny_target()
    batch = chat_batch()
    losses = {}
    for distill in (False, True):
        drafter = build(target, randomize=False, num_heads=3, num_layers=2, distill=distill)
        seeded_init_(drafter, seed=1, std=0.05, keep=tuple(f"heads.{k}.lm_head.weight" for k in range(3)))
        losses[distill] = drafter.compute_loss(batch, drafter.prepare(batch, TrainingContext(target)).target).loss
    assert losses[False].item() == pytest.approx(PINNED_HARD, rel=1e-5)
    assert losses[True].item() == pytest.approx(PINNED_DISTILL, rel=1e-5)


PINNED_HARD, PINNED_DISTILL = 20.762581, 19.798689


def test_medusa_loss_by_hand():
    """Two heads, weights 1 and 0.5: hard labels are one-hot soft labels, and a head with no position is 0."""
    logits = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), torch.tensor([[0.0, 0.0, 3.0]]), torch.zeros(0, 3)]
    labels = [torch.tensor([0, 1]), torch.tensor([2]), torch.zeros(0, dtype=torch.long)]
    loss, per_head = medusa_loss(logits, labels, head_weights(3, 0.5))
    ce0 = (-torch.log_softmax(logits[0], -1)[[0, 1], [0, 1]]).mean()
    ce1 = -torch.log_softmax(logits[1], -1)[0, 2]
    assert_close(per_head[0], ce0) and assert_close(per_head[1], ce1) and per_head[2] == 0
    assert_close(loss, ce0 + 0.5 * ce1)
    one_hot = [F.one_hot(y, 3).float() for y in labels]
    assert_close(medusa_loss(logits, one_hot, head_weights(3, 0.5))[0], loss)
    assert head_weights(4, 0.8) == pytest.approx([1.0, 0.8, 0.64, 0.512])


def test_predicted_positions_follow_the_masks():
    batch = chat_batch()
    mask = predicted_positions(batch, 3)  # head 1
    assert mask.shape == (2, 17)
    assert not mask[0, :2].any() and mask[0, 2:].all()  # token t+3 in the answer (loss_mask from 5)
    assert mask[1, :10].all() and not mask[1, 10:].any()  # row 2: token t+3 is padding from t = 10
    packed = predicted_positions(packed_batch(), 2)
    assert packed[0, :8].all() and not packed[0, 8:10].any() and packed[0, 10:].all()  # never across documents


def test_a_reduced_vocabulary_counts_only_tokens_the_heads_can_emit():
    """Hard labels outside the draft vocabulary are not trained on; distillation on the draft rows
    alone gives the loss of distillation on the full logits, renormalised to those rows."""
    target = tiny_target()
    keep = torch.arange(0, VOCAB, 2)
    batch = chat_batch()
    hard = build(target, vocab_ids=keep, num_heads=2)
    out = hard.compute_loss(batch, hard.prepare(batch, TrainingContext(target)).target)
    labels_kept = [batch["input_ids"][:, k + 2:][predicted_positions(batch, k + 2)] for k in range(2)]
    assert any((label % 2 == 1).any() for label in labels_kept)  # the batch has tokens outside the vocabulary
    in_vocab = {**batch, "loss_mask": batch["loss_mask"] * (batch["input_ids"] % 2 == 0)}  # in-vocabulary labels
    assert_close(out.loss, hard.compute_loss(in_vocab, target_outputs(target, in_vocab, "none")).loss)
    soft = build(target, vocab_ids=keep, num_heads=2, distill=True)
    rows = soft.prepare(batch, TrainingContext(target)).target
    assert rows.logits.shape[-1] == len(keep)  # the target computed the draft rows only
    assert_close(soft.compute_loss(batch, rows).loss, soft.compute_loss(batch, target_outputs(target, batch)).loss)


def test_metrics_per_head_top1_and_top_k():
    target = tiny_target()
    drafter = build(target, num_heads=2, accuracy_top_k=3)
    batch = chat_batch()
    out = drafter.compute_loss(batch, drafter.prepare(batch, TrainingContext(target)).target)
    hidden = target_outputs(target, batch).final_hidden
    for k in range(2):
        mask = predicted_positions(batch, k + 2)
        logits = drafter.heads[k](hidden[:, : mask.shape[1]])[mask]
        labels = batch["input_ids"][:, k + 2:][mask]
        assert out.metrics[f"acc_{k}"].item() == pytest.approx((logits.argmax(-1) == labels).float().mean().item())
        top3 = (logits.topk(3, -1).indices == labels[:, None]).any(-1).float().mean().item()
        assert out.metrics[f"top3_{k}"].item() == pytest.approx(top3)
    assert {"loss_0", "loss_1", "cond_acc_1", "sim_accept_len"} <= set(out.metrics)


def test_training_steps_reduce_the_loss():
    target = tiny_target()
    drafter = build(target, randomize=False, num_heads=3)
    batch = chat_batch()
    example = drafter.prepare(batch, TrainingContext(target))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    first = drafter.compute_loss(batch, example.target).loss.item()
    for _ in range(10):
        loss = drafter.compute_loss(batch, example.target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert drafter.compute_loss(batch, example.target).loss.item() < 0.7 * first
    assert all(torch.count_nonzero(head.resblocks[0].linear.weight) > 0 for head in drafter.heads)  # W1 left 0


def test_warmup_is_a_ratio_of_the_steps_unless_warmup_steps_are_given():
    from spine import warmup_cosine_lr

    raw = {"target": {"path": "some/model"}, "drafter": {"family": "medusa1", "warmup_ratio": 0.25},
           "data": {"path": "d.jsonl"}, "training": {"max_steps": 10}, "checkpoint": {"output_dir": "runs/x"}}
    recipe = parse_recipe(raw)
    assert recipe.optimizer.lr == 1e-3 and recipe.optimizer.betas == [0.9, 0.999]  # the reference command's
    assert recipe.optimizer.weight_decay == 0.0 and recipe.training.max_grad_norm == 1.0
    for warmup_steps, expected_warmup in ((0, 3), (5, 5)):  # ceil(0.25 * 10) = 3
        recipe.optimizer.warmup_steps = warmup_steps
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
        scheduler = medusa_lr_schedule(optimizer, recipe, 10)
        for step in range(10):
            assert scheduler.get_last_lr()[0] == pytest.approx(warmup_cosine_lr(step, 1e-3, expected_warmup, 10, 0))
            optimizer.step()
            scheduler.step()


# -- decoding --------------------------------------------------------------------------------------------


def test_a_proposal_is_one_pass_of_every_head_over_the_last_committed_hidden_state():
    """After start, and after a commit of n + 1 tokens, draft k is head k's top-1 on the hidden state of
    the last committed token, and q its (warped) distribution, in target ids."""
    target = tiny_target()
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[: VOCAB // 2]
    drafter = build(target, vocab_ids=keep, num_heads=4)
    ids = random_ids(1, 16, seed=5)
    hidden = target(ids).final_hidden
    source = drafter.draft_source(target)
    source.start(ids[:, :6], target(ids[:, :6]))
    for last, k, params in ((5, 4, GREEDY), (5, 2, SamplingParams(temperature=0.7)), (8, 6, GREEDY)):
        if last == 8:  # commit [pending, d1, d2] at positions 6, 7, 8
            source.commit(ids[:, 6:9], target(ids, logits="none").slice(slice(6, 9)))
        proposal = source.propose(ids[:, last + 1: last + 2], k, params, torch.Generator().manual_seed(0))
        n = min(k, 4)
        q = in_target_vocab(drafter, drafter.head_logits(hidden[:, last], n))
        expected = logits_to_probs(q, params)
        assert proposal.parents is None and proposal.tokens.shape == (1, n)
        if params.is_greedy:  # the argmaxes, and no V-wide q (the decoder compares drafts with argmaxes)
            assert proposal.probs is None and torch.equal(proposal.tokens, expected.argmax(-1))
            continue
        assert_close(proposal.probs, expected)  # the prompt's forward vs the whole sequence's: rounding
        assert (proposal.probs.gather(-1, proposal.tokens[..., None]) > 0).all()  # drawn from q's support


def greedy_setup():
    target = tiny_target(std=0.5)
    drafter = build(target, randomize=False, num_heads=4)
    return target, drafter


@pytest.mark.parametrize("k", [1, 4, 6])
def test_greedy_decoding_is_the_targets_own(k):
    """At T = 0 the output is plain greedy decoding's, token for token; some drafts are accepted (the
    heads start as the target's head, which this peaked target's loops make right), so both the
    accept and the reject paths run."""
    target, drafter = greedy_setup()
    accepted = 0
    for seed in range(4):
        prompt = random_ids(1, 6, seed=10 + seed)
        plain = plain_decode(target, prompt, max_new_tokens=40)
        spec = speculative_decode(target, drafter.draft_source(target), prompt, k=k, max_new_tokens=40)
        assert spec.tokens == plain.tokens
        assert max(s.num_drafted for s in spec.steps) == min(k, 4)  # K heads draft at most K tokens
        accepted += sum(s.num_accepted for s in spec.steps)
    assert accepted > 0


def test_sampling_emits_the_targets_marginals():
    """T = 1: the heads' q lives on a reduced draft vocabulary and goes to target ids through the map;
    the decoder's output still follows the target (the statistics of test_decode_statistics.py)."""
    from test_decode_statistics import (
        EAGLE_VOCAB,
        PROMPT,
        SAMPLED,
        all_checks,
        decode_many,
    )
    from test_verify_statistics import assert_all_pass

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=EAGLE_VOCAB, max_position_embeddings=64)
    target = FrozenTarget.from_config(config, device="cpu")
    seeded_init_(target.model, seed=0, std=0.5)
    vocab = DraftVocab.from_target_ids(torch.arange(2, EAGLE_VOCAB), EAGLE_VOCAB)  # misses tokens 0 and 1
    drafter = MEDUSA1.build(target, MedusaConfig(num_heads=3, draft_vocab_size=vocab.size), vocab).eval()
    decodes = decode_many(target, lambda: drafter.draft_source(target), SAMPLED, PROMPT, 400, num_tokens=6)
    assert_all_pass(all_checks(decodes, target, SAMPLED))
    accepted = sum(s.num_accepted for s in decodes.steps) / sum(min(s.num_accepted + 1, s.num_drafted)
                                                                 for s in decodes.steps)
    assert 0.1 < accepted < 0.9


# -- save, load, and the target they belong to -------------------------------------------------------------


@pytest.mark.parametrize("reduced", [False, True])
def test_save_load_gives_identical_heads(reduced, tmp_path):
    target = tiny_target()
    drafter = build(target, vocab_ids=torch.arange(0, VOCAB, 4) if reduced else None, num_heads=3, num_layers=2,
                    distill=True)
    drafter.save_pretrained(tmp_path / "d")
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["family"] == "medusa1" and saved["config"]["num_layers"] == 2 and saved["target_fingerprint"]
    loaded = load_drafter(tmp_path / "d", target)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    hidden = target(random_ids(1, 8, seed=6)).final_hidden
    assert torch.equal(loaded.head_logits(hidden), drafter.head_logits(hidden))


def test_loading_heads_on_another_target_is_refused(tmp_path):
    target = tiny_target(seed=0)
    build(target).save_pretrained(tmp_path / "d")
    with pytest.raises(SpecdraftError, match="hidden_size=64, but this target has 32"):
        load_drafter(tmp_path / "d", tiny_target(hidden_size=32))
    with pytest.raises(SpecdraftError, match="vocab_size=256, but this target has 300"):
        load_drafter(tmp_path / "d", tiny_target(vocab_size=300))
    with pytest.raises(SpecdraftError, match="another target with the same dimensions"):
        load_drafter(tmp_path / "d", tiny_target(seed=1))  # same architecture, other weights
    rounded = tiny_target(seed=0)
    rounded.model.to(torch.bfloat16)  # the same checkpoint loaded in bf16 is the same target
    assert load_drafter(tmp_path / "d", rounded).draft_vocab_size == VOCAB


# -- export --------------------------------------------------------------------------------------------------


def make_run(tmp_path, drafter, target) -> tuple[Path, Path]:
    """A run folder (drafter + recipe naming a saved copy of the target)."""
    target_dir = tmp_path / "target"
    target.model.save_pretrained(target_dir)
    run = tmp_path / "run"
    drafter.save_pretrained(run / "drafter")
    (run / "recipe.yaml").write_text(yaml.safe_dump({"target": {"path": str(target_dir)}}))
    return run, target_dir


def read(folder):
    """An export's config and tensors, from the file its consumer opens."""
    name = "medusa_lm_head.safetensors" if (folder / "medusa_lm_head.safetensors").is_file() else "model.safetensors"
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / name))


def resblocks(x, blocks):
    """x + SiLU(W x + b), layer after layer; ``blocks`` is [(W, b or None)]."""
    for weight, bias in blocks:
        x = x + F.silu(F.linear(x, weight, bias))
    return x


def fasterdecoding_loads(folder):
    """FasterDecoding/Medusa (main, e2a5d20) medusa/model/medusa_model.py and medusa_model_legacy.py:
    MedusaConfig reads medusa_num_heads, medusa_num_layers, base_model_name_or_path; hidden_size and
    vocab_size come from the base model's config; medusa_head[h] = Sequential(ResBlock x L,
    Linear(H, V, bias=False)), ResBlock.linear = nn.Linear(H, H) (biased). The state dict names are
    {h}.{l}.linear.weight / .bias and {h}.{L}.weight (load_state_dict(strict=False): held strict here).
    TGI's layers/medusa.py and TensorRT-LLM's models/medusa/weight.py read the same names, each layer
    its own (FasterDecoding's own model ties them: ``[ResBlock] * L``)."""
    c, tensors = read(folder)
    base = AutoConfig.from_pretrained(c["base_model_name_or_path"])
    K, L, H, V = c["medusa_num_heads"], c["medusa_num_layers"], base.hidden_size, base.vocab_size
    params = {}
    for h in range(K):
        for layer in range(L):
            params[f"{h}.{layer}.linear.weight"], params[f"{h}.{layer}.linear.bias"] = (H, H), (H,)
        params[f"{h}.{L}.weight"] = (V, H)
    assert set(tensors) == set(params), (set(tensors) ^ set(params))
    for name, shape in params.items():
        assert tuple(tensors[name].shape) == shape, name
    heads = [([(tensors[f"{h}.{layer}.linear.weight"], tensors[f"{h}.{layer}.linear.bias"]) for layer in range(L)],
              tensors[f"{h}.{L}.weight"]) for h in range(K)]
    return lambda hidden: torch.stack([F.linear(resblocks(hidden, blocks), head) for blocks, head in heads], -2)


def vllm_medusa_config(c: dict) -> dict:
    """vllm/transformers_utils/configs/medusa.py MedusaConfig: from_pretrained renames every key holding
    "num" and "heads" to num_heads, "num" and "layers" to num_hidden_layers; defaults hidden_size 4096,
    vocab_size 32001, num_heads 5, num_hidden_layers 1, truncated_vocab_size None -> vocab_size."""
    c = dict(c)
    for key in list(c):
        if "num" in key and "heads" in key:
            c["num_heads"] = c.pop(key)
        elif "num" in key and "layers" in key:
            c["num_hidden_layers"] = c.pop(key)
    assert c.get("model_type") == "medusa"  # AutoConfig picks MedusaConfig by model_type
    out = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5, "num_hidden_layers": 1, **c}
    out["truncated_vocab_size"] = c.get("truncated_vocab_size") or out["vocab_size"]
    return out


def vllm_loads(folder, dropped: list | None = None):
    """vllm/model_executor/models/medusa.py (09cddad): blocks.{h}.layers.{l} = Linear(H, H,
    bias=medusa_fc_bias (default False)); lm_heads.{h} = ParallelLMHead(truncated_vocab_size, H) unless
    original_lm_head; load_weights strips "medusa_heads.", keeps token_map only when truncated <
    vocab, drops unknown names silently (collected in ``dropped``), slices lm_heads rows by token_map,
    asserts truncated == vocab or a token_map; compute_logits scatters to token_map's ids, -inf elsewhere.
    vllm/v1/spec_decode/medusa.py drafts each head's argmax."""
    c, tensors = read(folder)
    c = vllm_medusa_config(c)
    K, L, H = c["num_heads"], c["num_hidden_layers"], c["hidden_size"]
    V, N = c["vocab_size"], c["truncated_vocab_size"]
    assert not c.get("original_lm_head", False)
    params = {}
    for h in range(K):
        for layer in range(L):
            params[f"blocks.{h}.layers.{layer}.weight"] = (H, H)
            if c.get("medusa_fc_bias", False):
                params[f"blocks.{h}.layers.{layer}.bias"] = (H,)
        params[f"lm_heads.{h}.weight"] = (N, H)
    loaded, token_map = {}, None
    for name, tensor in tensors.items():
        name = name.replace("medusa_heads.", "")
        if name == "token_map":
            if N < V:
                token_map = tensor
        elif name in params:
            loaded[name] = tensor
        elif dropped is not None:
            dropped.append(name)
    for name, tensor in loaded.items():
        if "lm_head" in name and token_map is not None and tensor.shape[0] > token_map.shape[0]:
            loaded[name] = tensor[token_map]
    assert N == V or token_map is not None
    assert set(loaded) == set(params), set(loaded) ^ set(params)  # every parameter filled
    for name, shape in params.items():
        assert tuple(loaded[name].shape) == shape, name

    def logits(hidden):
        out = []
        for h in range(K):
            blocks = [(loaded[f"blocks.{h}.layers.{layer}.weight"], loaded.get(f"blocks.{h}.layers.{layer}.bias"))
                      for layer in range(L)]
            head = F.linear(resblocks(hidden, blocks), loaded[f"lm_heads.{h}.weight"])
            if token_map is not None:
                full = head.new_full((*head.shape[:-1], V), float("-inf"))
                full[..., token_map] = head
                head = full
            out.append(head)
        return torch.stack(out, -2)

    return logits


def assert_same_logits(engine: torch.Tensor, ours: torch.Tensor) -> None:
    """The same -inf (outside a reduced vocabulary) and, elsewhere, the same values up to float32
    rounding of the same weights (the engines' F.linear against nn.Linear: no difference expected)."""
    assert torch.equal(engine.isinf(), ours.isinf())
    finite = ours.isfinite()
    assert_close(engine[finite], ours[finite], rel=1e-6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Randomized heads (2 layers, biased), full and reduced vocabulary, in run folders."""
    runs = {}
    for name, keep in (("full", None), ("reduced", torch.arange(1, VOCAB, 3))):
        tmp = tmp_path_factory.mktemp(name)
        target = tiny_target()
        drafter = build(target, vocab_ids=keep, num_heads=3, num_layers=2)
        run, target_dir = make_run(tmp, drafter, target)
        runs[name] = (target, drafter, run, target_dir)
    return runs


def hidden_states(target):
    return target(random_ids(2, 10, seed=7)).final_hidden


@pytest.mark.parametrize("fmt, loads, vocab", [("medusa", fasterdecoding_loads, "full"),
                                               ("vllm", vllm_loads, "full"), ("vllm", vllm_loads, "reduced")])
def test_the_engines_run_the_exported_heads(trained, tmp_path, fmt, loads, vocab):
    target, drafter, run, _ = trained[vocab]
    out = export(run, fmt, tmp_path / fmt)
    dropped = []
    engine = loads(out, dropped) if loads is vllm_loads else loads(out)
    assert not dropped  # nothing the engine would pass over
    hidden = hidden_states(target)
    assert_same_logits(engine(hidden), in_target_vocab(drafter, drafter.head_logits(hidden)))


def test_export_configs_are_pinned(trained, tmp_path):
    _, _, run, _ = trained["reduced"]
    config, tensors = read(export(run, "vllm", tmp_path / "vllm"))
    assert config == {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 64,
                      "vocab_size": VOCAB, "num_heads": 3, "num_hidden_layers": 2, "truncated_vocab_size": 85,
                      "medusa_fc_bias": True, "original_lm_head": False, "torch_dtype": "float32",
                      "dtype": "float32"}
    assert torch.equal(tensors["token_map"], torch.arange(1, VOCAB, 3))
    _, _, run, target_dir = trained["full"]
    config, _ = read(export(run, "medusa", tmp_path / "medusa"))
    assert config == {"medusa_num_heads": 3, "medusa_num_layers": 2,
                      "base_model_name_or_path": str(target_dir.resolve())}
    # the file FasterDecoding, TGI and TensorRT-LLM open
    assert sorted(p.name for p in (tmp_path / "medusa").iterdir()) == [
        ".specdraft-owner.json", "config.json", "medusa_lm_head.safetensors", "specdraft.json"]  # the first: export's mark


def test_without_medusa_fc_bias_vllm_would_drop_the_trained_biases(trained, tmp_path):
    """The field the issue asks for: vLLM's default (no bias) loads the folder but runs other heads."""
    target, drafter, run, _ = trained["full"]
    out = export(run, "vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    del config["medusa_fc_bias"]
    (out / "config.json").write_text(json.dumps(config))
    dropped = []
    engine = vllm_loads(out, dropped)
    assert len(dropped) == 3 * 2 and all(name.endswith(".bias") for name in dropped)
    hidden = hidden_states(target)
    assert not torch.allclose(engine(hidden), drafter.head_logits(hidden))


@pytest.mark.parametrize("fmt, vocab", [("medusa", "full"), ("vllm", "full"), ("vllm", "reduced"),
                                        ("hf", "full"), ("hf", "reduced")])
def test_an_export_reads_back_to_identical_heads(trained, tmp_path, fmt, vocab):
    target, drafter, run, _ = trained[vocab]
    loaded = load_exported(export(run, fmt, tmp_path / fmt), target)
    hidden = hidden_states(target)
    assert torch.equal(loaded.head_logits(hidden), drafter.head_logits(hidden))


def test_heads_trained_without_resblock_bias_export_zero_biases_to_fasterdecoding(tmp_path):
    """FasterDecoding's ResBlock always has a bias: a drafter without one ships zeros; vLLM gets none."""
    target = tiny_target()
    drafter = build(target, num_heads=2, resblock_bias=False)
    run, _ = make_run(tmp_path, drafter, target)
    _, tensors = read(export(run, "medusa", tmp_path / "medusa"))
    assert not tensors["0.0.linear.bias"].any()
    hidden = hidden_states(target)
    assert_close(fasterdecoding_loads(tmp_path / "medusa")(hidden), drafter.head_logits(hidden), rel=1e-6)
    config, tensors = read(export(run, "vllm", tmp_path / "vllm"))
    assert config["medusa_fc_bias"] is False and not any(name.endswith("bias") for name in tensors)
    assert torch.equal(load_exported(tmp_path / "medusa", target).head_logits(hidden), drafter.head_logits(hidden))


def test_the_serve_hints_name_the_engines_and_say_sglang_has_none(trained, tmp_path, capsys):
    from specdraft.cli import main

    _, _, run, _ = trained["full"]
    for fmt in ("medusa", "vllm", "hf"):
        assert main(["export", str(run), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
        printed = capsys.readouterr().out
        assert "SGLang has no Medusa support" in printed and str(tmp_path / fmt) in printed
        if fmt == "vllm":  # the export's own head count, which vLLM reads as its drafts per step
            heads = json.loads((run / "drafter" / "config.json").read_text())["config"]["num_heads"]
            assert f'"num_speculative_tokens": {heads}}}' in printed
    with pytest.raises(SpecdraftError, match="cannot be exported as sglang"):
        export(run, "sglang", tmp_path / "sglang")


# -- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, match", [
    ({"num_heads": 0}, "num_heads must be an integer >= 1"),
    ({"num_layers": 0}, "num_layers must be an integer >= 1"),
    ({"loss_decay": 0.0}, r"loss_decay must be in \(0, 1\]"),
    ({"loss_decay": 1.5}, r"loss_decay must be in \(0, 1\]"),
    ({"draft_vocab_size": 0}, "draft_vocab_size must be >= 1"),
    ({"accuracy_top_k": 0}, "accuracy_top_k must be an integer >= 1"),
    ({"warmup_ratio": 1.0}, r"warmup_ratio must be in \[0, 1\)"),
])
def test_bad_config_values(cfg, match):
    with pytest.raises(SpecdraftError, match=match):
        MedusaConfig(**cfg)


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_before_loading():
    with pytest.raises(SpecdraftError, match="above the target's vocabulary of 256"):
        MEDUSA1.needs(MedusaConfig(draft_vocab_size=300), LlamaConfig(**CONFIG))


def test_a_reduced_vocabulary_needs_its_map_off_meta():
    with pytest.raises(SpecdraftError, match="need a draft vocabulary built from the data"):
        MEDUSA1.build(tiny_target(), MedusaConfig(draft_vocab_size=100))


def test_a_vllm_export_of_a_reduced_vocabulary_without_its_map_is_refused(trained, tmp_path):
    """The drafter folder lost its d2t/t2d: no token_map could be written, and vLLM refuses
    truncated_vocab_size < vocab_size without one. An export that lost its token_map does not read back."""
    target, _, run, _ = trained["reduced"]
    broken = tmp_path / "run"
    (broken / "drafter").mkdir(parents=True)
    (broken / "drafter" / "config.json").write_text((run / "drafter" / "config.json").read_text())
    tensors = load_file(str(run / "drafter" / "model.safetensors"))
    save_file({k: t for k, t in tensors.items() if k not in ("d2t", "t2d")}, str(broken / "drafter" /
                                                                                    "model.safetensors"))
    (broken / "recipe.yaml").write_text((run / "recipe.yaml").read_text())
    with pytest.raises(SpecdraftError, match="no vocabulary map.*vLLM refuses truncated_vocab_size < vocab_size"):
        export(broken, "vllm", tmp_path / "vllm")
    out = export(run, "vllm", tmp_path / "ok")
    _, tensors = read(out)
    del tensors["token_map"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecdraftError, match="no token_map"):
        load_exported(out, target)


def test_fasterdecodings_layout_has_no_vocabulary_map(trained, tmp_path):
    _, _, run, _ = trained["reduced"]
    with pytest.raises(SpecdraftError, match="cover the target's whole vocabulary.*--format vllm"):
        export(run, "medusa", tmp_path / "medusa")


# -- recipes -------------------------------------------------------------------------------------------------

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*medusa1.yaml"))


def test_the_medusa_recipes_exist():
    assert {p.name for p in RECIPES} >= {"toy_medusa1.yaml", "smollm2-135m-medusa1.yaml", "llama3.1-8b-medusa1.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_each_recipe_builds_its_heads_on_meta_with_real_dims(path):
    from test_config import recipe_on_meta

    recipe, config, target = recipe_on_meta(path, "medusa1")
    cfg = recipe.drafter
    vocab = None
    if cfg.reduces_vocab(config.vocab_size):
        vocab = DraftVocab.from_target_ids(torch.arange(cfg.draft_vocab_size), config.vocab_size)
    drafter = MEDUSA1.build(target, cfg, vocab)
    H, N = config.hidden_size, cfg.draft_vocab_size or config.vocab_size
    assert sum(p.numel() for p in drafter.trained_module().parameters()) == \
        cfg.num_heads * (cfg.num_layers * (H * H + H * cfg.resblock_bias) + N * H)
    assert recipe.eval.k == cfg.num_heads  # every head drafts


# -- a real run: `specdraft train`, killed with kill -9, resumed ------------------------------------------------

def killing_cli(module: str, drafter_class: str, training: str = "self.training") -> str:
    """A `specdraft` entry point whose ``drafter_class.compute_loss`` SIGKILLs its own process at the
    PROBE_KILL_AT_CALL-th training micro-batch (``training``: how the drafter tells a training call
    from the held-out eval's); the hook tests/probe_family.py gives the probe."""
    return textwrap.dedent(f"""
        import os, signal, sys
        from specdraft.cli import main
        from {module} import {drafter_class}

        real, calls = {drafter_class}.compute_loss, [0]

        def compute_loss(self, batch, target_out):
            if {training}:
                calls[0] += 1
                if calls[0] == int(os.environ.get("PROBE_KILL_AT_CALL", 0)):
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(self, batch, target_out)

        {drafter_class}.compute_loss = compute_loss
        sys.exit(main())
    """)


KILLING_CLI = killing_cli("specdraft.drafters.medusa", "MedusaDrafter")

KILL_STEPS, KILL_SAVE_EVERY, KILL_AT_STEP = 10, 4, 7


def killed_run_of(folder: Path, recipe: dict, kill_at_step: int, checkpoint_step: int, cli: str = KILLING_CLI):
    """A KilledRun whose `specdraft train` kills itself through ``cli`` (by default KILLING_CLI: Medusa-1's
    compute_loss, which Medusa-2's calls once per micro-batch too)."""
    from spine import KilledRun

    class KilledMedusaRun(KilledRun):
        def _train(self, name, flags, env=None):
            recipe = json.loads(json.dumps(self.recipe))
            recipe["checkpoint"]["output_dir"] = str(self.tmp / name / "run")
            path = self.tmp / f"{name}.yaml"
            path.write_text(yaml.safe_dump(recipe))
            (self.tmp / "cli.py").write_text(cli)
            full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
            return subprocess.run([sys.executable, str(self.tmp / "cli.py"), "train", str(path), "--no-progress",
                                   *flags], check=False, env=full_env, capture_output=True, text=True, timeout=900)

    accumulation = recipe["training"]["grad_accumulation"]
    return KilledMedusaRun(folder, recipe, kill_at_call=(kill_at_step - 1) * accumulation + 1,
                           checkpoint_step=checkpoint_step)


def medusa_killed_runs(folder: Path):
    from spine import make_recipe

    recipe = make_recipe(folder, folder / "target", folder / "chat.jsonl",
                         drafter={"family": "medusa1", "num_heads": 3, "warmup_ratio": 0.2},
                         optimizer={"lr": 1e-2, "warmup_steps": 0},
                         training={"max_steps": KILL_STEPS, "eval_every": 5},
                         checkpoint={"save_every": KILL_SAVE_EVERY})
    return killed_run_of(folder, recipe, KILL_AT_STEP, KILL_SAVE_EVERY)


@pytest.fixture(scope="module")
def killed_medusa_run(tmp_path_factory):
    from spine import built_killed_run

    return built_killed_run(tmp_path_factory, "medusa-kill-9", medusa_killed_runs)


def test_specdraft_train_runs_medusa_and_resumes_exactly_after_kill_9(killed_medusa_run):
    from spine import assert_logged_lr_schedule, read_metrics

    runs = killed_medusa_run
    straight = runs.straight
    drafter = json.loads((straight / "drafter" / "config.json").read_text())
    assert drafter["family"] == "medusa1" and drafter["config"]["num_heads"] == 3
    evals = [m for m in read_metrics(straight) if "eval/loss" in m]
    assert [m["step"] for m in evals] == [5, 10] and evals[1]["eval/loss"] < evals[0]["eval/loss"]
    assert {"eval/acc_0", "eval/acc_2", "eval/top5_0", "eval/sim_accept_len"} <= set(evals[0])
    assert_logged_lr_schedule(straight, 1e-2, 2, KILL_STEPS, 0.0)  # warmup = ceil(0.2 x 10)
    runs.check_resume("resumed")
