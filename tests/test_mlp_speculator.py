"""IBM's MLP speculator (arXiv 2404.19124; fms-extras MLPSpeculator; fms-fsdp's training).

The architecture against its equations, fms-fsdp's label offsets, the stage-2 generation, exact
decoding (greedy identity, and the target's marginals at T = 1), save/load, the fms-extras / vLLM
folder as their loaders read it (re-implemented here from their source), the recipes at real
dimensions, bad input, and a `specdraft train` run that switches to stage 2 and resumes exactly
after kill -9 across the switch.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import assert_close, seeded_init_
from transformers import LlamaConfig

from specdraft.config import load_recipe, parse_recipe
from specdraft.contract import TargetNeeds, TargetOutputs, TrainingContext
from specdraft.decoding.sampling import SamplingParams
from specdraft.decoding.speculative import plain_decode, speculative_decode
from specdraft.drafters import FAMILIES, get_family, load_drafter
from specdraft.drafters.mlp_speculator import (
    MLP_SPECULATOR,
    MLPSpeculatorConfig,
    build_mlp_speculator,
    cut_prompts,
    head_masks,
    per_head_cross_entropy,
    per_head_soft_loss,
    sample_continuations,
    stage2_batch,
    two_stage_lr_factor,
)
from specdraft.errors import SpecdraftError
from specdraft.losses import DRAFTER_LOSSES
from specdraft.target import FrozenTarget

VOCAB = 256
GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def tiny_target(vocab: int = VOCAB, hidden: int = 64, context: int = 256, std: float = 0.3) -> FrozenTarget:
    """A 2-layer Llama whose weights come from seeded_init_ (std 0.3: peaked next-token distributions),
    computing its final hidden state (building a speculator on it would ask for that too)."""
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=context)
    target = FrozenTarget.from_config(config, needs=TargetNeeds(final_hidden=True), device="cpu")
    seeded_init_(target.model, seed=0, std=std)
    return target


def speculator(target, seed: int = 1, **cfg):
    """A speculator with seeded weights; LN weights and biases drawn away from 1 and 0 so a swapped
    or missing one shows."""
    drafter = build_mlp_speculator(target, MLPSpeculatorConfig(**cfg))
    seeded_init_(drafter, seed=seed, std=0.2)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for ln in drafter.speculator.ln:
            ln.weight.copy_(torch.rand(ln.weight.shape, generator=g) + 0.5)
            ln.bias.copy_(torch.randn(ln.bias.shape, generator=g) * 0.1)
    return drafter


def random_ids(*shape, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def make_batch(B=2, T=20, seed=1, vocab=VOCAB):
    ids = random_ids(B, T, seed=seed, vocab=vocab)
    ones = torch.ones(B, T, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones.clone()}


def target_outputs(target, batch):
    """What the speculator's stage-1 prepare hands its loss: the target's hidden states, no logits."""
    return target.forward_batch(batch, logits="none")


def final_hidden(out):
    return out.final_hidden


def training_loss(drafter, target, batch, step: int = 0):
    """The loop's micro-batch: the drafter's own example (prepare), then its loss."""
    example = drafter.prepare(batch, TrainingContext(target, step=step))
    return drafter.compute_loss(example.batch, example.target)


# -- the architecture against its equations ---------------------------------------------------------


def rms(x, weight=None, bias=None, eps=1e-6):
    """fms LayerNormParameterized(use_mean=False): no mean subtraction."""
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight + bias


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))  # nn.GELU(), exact


def reference_heads(net, hidden, tokens_per_head):
    """The fms-extras forward, written out: s_{i+1} = GELU(LN_i(proj_i s_i + emb_weight/state_weight emb_i(x))),
    with the weights read through fms-extras' names."""
    n = len(tokens_per_head)
    state_weight = 0.5 ** (0.5 / n)
    inner = net.inner_dim
    emb_weight = math.sqrt((1 - state_weight**2) * inner / 2)
    w = {name: p for name, p in net.state_dict().items()}
    state = rms(hidden) / math.sqrt(2) if net.ln0 is not None else hidden
    logits = []
    for i, tokens in enumerate(tokens_per_head):
        z = w[f"emb.{i}.weight"][tokens]
        mixed = state @ w[f"proj.{i}.weight"].T + (emb_weight / state_weight) * z
        state = gelu(rms(mixed, w[f"ln.{i}.weight"], w[f"ln.{i}.bias"]))
        logits.append(state @ w[f"head.{i}.weight"].T)
    return logits


def test_the_scale_constants_are_fms_extras():
    target = tiny_target()
    net = build_mlp_speculator(target, MLPSpeculatorConfig(n_predict=3, inner_dim=32)).speculator
    assert net.state_weight == pytest.approx(0.5 ** (1 / 6)) and net.state_weight == pytest.approx(0.890899, abs=1e-6)
    assert net.emb_weight == pytest.approx(math.sqrt((1 - 0.5 ** (1 / 3)) * 16))  # inner 32: inner/2 = 16
    assert net.emb_weight == pytest.approx(1.816808, abs=1e-6)


@pytest.mark.parametrize("tie, scale", [(False, False), (True, True)])
def test_heads_match_the_equations(tie, scale):
    target = tiny_target()
    drafter = speculator(target, n_predict=3, inner_dim=48, tie_weights=tie, scale_input=scale)
    hidden = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3)) * 3 + 1  # off-centre: no mean subtraction
    ids = random_ids(2, 7, seed=4)
    logits = drafter.speculator(hidden, ids)
    shifted = [torch.cat([ids[:, i + 1:], torch.zeros(2, i + 1, dtype=torch.long)], 1) for i in range(3)]
    expected = reference_heads(drafter.speculator, hidden, shifted)
    for i in range(3):
        assert_close(logits[i], expected[i], what=f"head {i}:")
    # the norm has no mean subtraction: a LayerNorm would give other values
    mixed = torch.randn(5, 48, generator=torch.Generator().manual_seed(5)) + 2
    ln = drafter.speculator.ln[0]
    assert_close(ln(mixed), rms(mixed, ln.weight, ln.bias))
    assert (ln(mixed) - F.layer_norm(mixed, (48,), ln.weight, ln.bias, 1e-6)).abs().max() > 0.1


def test_parameter_names_and_shapes_are_fms_extras_hf():
    target = tiny_target()
    drafter = build_mlp_speculator(target, MLPSpeculatorConfig(n_predict=3, inner_dim=32))
    shapes = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    expected = {}
    for i in range(3):
        expected[f"speculator.emb.{i}.weight"] = (VOCAB, 32)
        expected[f"speculator.proj.{i}.weight"] = (32, 64 if i == 0 else 32)
        expected[f"speculator.head.{i}.weight"] = (VOCAB, 32)
        expected[f"speculator.ln.{i}.weight"] = (32,)
        expected[f"speculator.ln.{i}.bias"] = (32,)
    assert shapes == expected
    # inner_dim 0: the target's width (fms-extras' convention)
    assert build_mlp_speculator(target, MLPSpeculatorConfig()).speculator.inner_dim == 64


def test_tie_weights_shares_what_fms_extras_shares():
    target = tiny_target()
    net = build_mlp_speculator(target, MLPSpeculatorConfig(n_predict=4, inner_dim=32, tie_weights=True)).speculator
    for i in range(1, 4):
        assert net.emb[i].weight is net.emb[0].weight and net.head[i].weight is net.head[0].weight
        assert net.ln[i].weight is net.ln[0].weight and net.ln[i].bias is net.ln[0].bias
    assert net.proj[1].weight is not net.proj[0].weight  # proj_0 reads the target's width
    assert net.proj[2].weight is net.proj[1].weight and net.proj[3].weight is net.proj[1].weight
    count = sum(p.numel() for p in net.parameters())
    assert count == 2 * VOCAB * 32 + 64 * 32 + 32 * 32 + 2 * 32


def test_initialisation_is_fms_extras_reset_parameters():
    torch.manual_seed(0)
    target = tiny_target(vocab=4096)
    net = build_mlp_speculator(target, MLPSpeculatorConfig(n_predict=2, inner_dim=64)).speculator
    for name, p in net.named_parameters():
        if name.startswith("ln"):
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)), name
        else:  # N(0, 1/sqrt(inner)): 1/8; the sample std of >= 4096 draws is within 5% of it
            assert p.mean().abs() < 0.01 and abs(p.std().item() - 1 / 8) < 0.05 / 8, name


# -- training: labels, masks, loss --------------------------------------------------------------------


def test_head_i_learns_token_t_plus_i_plus_2():
    """Overfit one sequence: head i at position t then predicts ids[t + i + 2] (fms-fsdp's
    stage-1 labels input[:, i+2:]), and reads ids[t + i + 1]: a head trained one token off would
    predict the wrong neighbour."""
    torch.manual_seed(0)
    target = tiny_target()
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:24][None]  # no repeats: no ambiguity
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    drafter = speculator(target, n_predict=3, inner_dim=64)
    optimizer = torch.optim.AdamW(drafter.trained_module().parameters(), lr=1e-2)
    out = target_outputs(target, batch)
    for _ in range(150):
        optimizer.zero_grad()
        drafter.compute_loss(batch, out).loss.backward()
        optimizer.step()
    logits = drafter.speculator(final_hidden(out), ids)
    for i in range(3):
        predicted = logits[i][0, : 24 - i - 2].argmax(-1)
        assert torch.equal(predicted, ids[0, i + 2:]), f"head {i}"


def test_per_position_loss_is_fms_fsdp_stage1():
    """fms-fsdp stage1_loss: embeds of input[:, :-n-1], preds = speculator(embeds, input[:, 1:]),
    head i's CE against input[:, i+2 : N+i+2] (N = T - n - 1), summed over heads."""
    target = tiny_target()
    n, T = 3, 20
    drafter = speculator(target, n_predict=n, inner_dim=32)
    batch = make_batch(T=T)
    ids, hidden = batch["input_ids"], final_hidden(target_outputs(target, batch))
    N = T - n - 1
    inds = ids[:, 1:]
    reference = reference_heads(drafter.speculator, hidden[:, :N], [inds[:, i: i + N] for i in range(n)])
    fms_losses = [F.cross_entropy(reference[i].reshape(-1, VOCAB), ids[:, i + 2: N + i + 2].reshape(-1))
                  for i in range(n)]
    logits = drafter.speculator(hidden, ids)
    only_first_n = [torch.arange(T)[None].expand(2, T) < N] * n
    ours = per_head_cross_entropy(logits, ids, only_first_n)
    for i in range(n):
        assert ours[i].item() == pytest.approx(fms_losses[i].item(), rel=1e-5)
    # the drafter's loss is the (weighted) sum of its heads' CE, with every countable position
    weights = [1.0, 0.5, 0.25]
    drafter.config.head_weights = weights
    out = drafter.compute_loss(batch, target_outputs(target, batch))
    full = per_head_cross_entropy(logits, ids, head_masks(torch.ones(2, T), torch.ones(2, T), n))
    assert out.loss.item() == pytest.approx(sum(w * loss.item() for w, loss in zip(weights, full)), rel=1e-6)
    assert [out.metrics[f"loss_{i}"].item() for i in range(n)] == pytest.approx([x.item() for x in full], rel=1e-6)


def test_head_masks_count_real_same_document_labels():
    T = 10
    state_ok = torch.tensor([[1] * 8 + [0] * 2])  # two padding positions at the end
    label_ok = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0]])  # an answer at 3..7
    seq_ids = torch.tensor([[0] * 5 + [1] * 5])
    masks = head_masks(state_ok, label_ok, 2)
    # head i at t counts iff state t real and label t + i + 2 counted
    for i, mask in enumerate(masks):
        expected = [bool(state_ok[0, t] and t + i + 2 < T and label_ok[0, t + i + 2]) for t in range(T)]
        assert mask[0].tolist() == expected
    packed = head_masks(torch.ones(1, T), torch.ones(1, T), 2, seq_ids)
    assert packed[0][0].tolist() == [True] * 3 + [False] * 2 + [True] * 3 + [False] * 2
    assert packed[1][0].tolist() == [True] * 2 + [False] * 3 + [True] * 2 + [False] * 3


def test_a_few_steps_reduce_the_loss_and_leave_the_target_alone():
    target = tiny_target()
    batch = make_batch(B=4, T=24)
    drafter = speculator(target, n_predict=3, inner_dim=32, tie_weights=True, scale_input=True)
    optimizer = torch.optim.AdamW(drafter.trained_module().parameters(), lr=3e-3)
    out = target_outputs(target, batch)
    losses = []
    for _ in range(15):
        result = drafter.compute_loss(batch, out)
        assert all(v.shape == () and not v.requires_grad for v in result.metrics.values())
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        losses.append(result.loss.item())
    assert losses[-1] < 0.85 * losses[0]
    assert not any(p.requires_grad for p in target.parameters())
    assert {f"acc_{i}" for i in range(3)} | {"sim_accept_len", "stage"} <= set(result.metrics)


# -- stage 2 ------------------------------------------------------------------------------------------


def test_cut_prompts_end_inside_answers_in_windows_of_one_document_of_real_tokens():
    """Prompts end where answer text (loss_mask) is, so the target continues the assistant: the first at an
    answer's first token with `length` tokens of its document before it, the next `length` tokens on."""
    ids = torch.arange(24).view(2, 12)
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 9:] = 0  # row 1 has 9 real tokens
    loss = torch.zeros(2, 12, dtype=torch.long)
    loss[0, 3:6] = 1  # row 0, document 0 (positions 0-5): the answer is 3-5
    loss[0, 9:] = 1  # document 1 (6-11): 9-11
    loss[1, 2:9] = 1  # row 1, one document: 2-8
    seq_ids = torch.tensor([[0] * 6 + [1] * 6, [0] * 12])
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss, "seq_ids": seq_ids}
    # length 2: each answer's first token has 2 before it; then every 2 tokens into the answer
    assert cut_prompts(batch, 2, per_row=9).tolist() == [[1, 2], [3, 4], [7, 8], [9, 10],
                                                          [12, 13], [14, 15], [16, 17], [18, 19]]
    # length 3: row 1's answer starts at 2, with 2 tokens before it: its first prompt ends at 3 (holds token 14)
    assert cut_prompts(batch, 3, per_row=9).tolist() == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [15, 16, 17]]
    assert cut_prompts(batch, 3, per_row=1).tolist() == [[0, 1, 2], [12, 13, 14]]
    # length 4: each of row 0's documents has room for one prompt, ending at its answer's second token
    assert cut_prompts(batch, 4, per_row=9).tolist() == [[0, 1, 2, 3], [6, 7, 8, 9], [12, 13, 14, 15],
                                                          [16, 17, 18, 19]]
    with pytest.raises(SpecdraftError, match="stage2_prompt_length=9 tokens before answer text.*longest sample has 12"):
        cut_prompts(batch, 9, per_row=1)
    # text data (every real token a label): windows one after another, as fms-fsdp's, each followed by more of its
    # document (3-5 ends document 0, 18-20 row 1's text)
    text = {**batch, "loss_mask": attention}
    assert cut_prompts(text, 3, per_row=5).tolist() == [[0, 1, 2], [6, 7, 8], [12, 13, 14], [15, 16, 17]]


def test_sample_continuations_are_the_targets_cached_samples():
    """Batched, KV-cached: the hidden states are those of one teacher-forced forward over the result,
    every token is among the target's top-k there, top-k 1 is greedy decoding, and the same global
    seed gives the same continuations (what an exact resume relies on)."""
    target = tiny_target()
    prompts = random_ids(3, 6, seed=8)
    torch.manual_seed(0)
    ids, hidden, logits = sample_continuations(target, prompts, 10, SamplingParams(temperature=1.0, top_k=10))
    assert ids.shape == (3, 16) and hidden.shape == (3, 15, 64) and torch.equal(ids[:, :6], prompts)
    teacher = target(ids)
    assert_close(hidden, final_hidden(teacher)[:, :15], what="cached vs teacher-forced hidden:")
    top10 = teacher.logits[:, 5:15].topk(10, dim=-1).indices
    assert (top10 == ids[:, 6:, None]).any(-1).all()
    torch.manual_seed(0)
    again, _, _ = sample_continuations(target, prompts, 10, SamplingParams(temperature=1.0, top_k=10))
    assert torch.equal(ids, again)
    greedy, _, _ = sample_continuations(target, prompts, 10, SamplingParams(temperature=1.0, top_k=1))
    for row in range(3):
        assert greedy[row, 6:].tolist() == plain_decode(target, prompts[row:row + 1], max_new_tokens=10).tokens


def test_stage2_trains_on_generated_tokens_with_fms_fsdp_offsets():
    """fms-fsdp stage2_loss: the states are the embeds from the last prompt position on (the one that
    predicted the first generated token g_0), preds = speculator(embeds, targs[:, :-1]), head i's
    labels targs[:, i+1:] (g_{i+1}, ...). Here: head i's first counted state is P - 1, its label
    g_{i+1}; every later generated label counts (fms-fsdp cuts all heads to S - n states)."""
    target = tiny_target()
    cfg = MLPSpeculatorConfig(n_predict=3, inner_dim=32, stage2_start_step=0, stage2_prompt_length=5,
                              stage2_new_tokens=9, stage2_prompts_per_row=2)
    batch = make_batch(B=2, T=12)
    torch.manual_seed(0)
    generated, target_out = stage2_batch(target, batch, cfg)
    hidden = target_out.final_hidden
    P, S = 5, 9
    ids = generated["input_ids"]
    assert ids.shape == (4, P + S) and torch.equal(ids[:, :P], cut_prompts(batch, 5, 2))  # 2 windows per row
    masks = head_masks(generated["state_mask"], generated["loss_mask"], 3)
    for i, mask in enumerate(masks):
        counted = mask[0].nonzero().flatten().tolist()
        assert counted == list(range(P - 1, P + S - i - 2)), f"head {i}"
        assert counted[0] + i + 2 == P + i + 1  # label g_{i+1}, as in fms-fsdp
    # the hidden states are the target's over the generated sequences
    assert_close(hidden[:, :-1], final_hidden(target(ids))[:, :-1])
    # prepare switches after stage2_start_step training steps; held-out batches stay on stage 1
    drafter = speculator(target, n_predict=3, inner_dim=32, stage2_start_step=4, stage2_prompt_length=5,
                         stage2_new_tokens=9)
    assert "state_mask" in drafter.prepare(batch, TrainingContext(target, step=4)).batch
    assert "state_mask" not in drafter.prepare(batch, TrainingContext(target, step=3)).batch
    assert "state_mask" not in drafter.prepare(batch, TrainingContext(target, step=9, training=False)).batch
    # and the loss on them is the stage-2 one, over those positions
    out = drafter.compute_loss(generated, TargetOutputs(final_hidden=hidden))
    logits = drafter.speculator(hidden, ids)
    assert out.metrics["stage"].item() == 2.0
    assert out.loss.item() == pytest.approx(sum(x.item() for x in per_head_cross_entropy(logits, ids, masks)), rel=1e-6)


def test_the_lr_schedule_is_fms_fsdps_two_stages():
    """fms-fsdp speculator/train_speculator.py, written out with its constants (peak 1, floor 0.1; stage 2
    re-warms to 0.1 and decays to 0.01), for its own run: 21000 steps, stage 2 from 15000."""
    total, s1 = 21000, 15000
    w1, w2 = min(2000, s1 // 20), min(2000, (total - s1) // 20)

    def fms(x):
        if x <= s1:
            return min(1 - (1 - min(x, w1) / w1) ** 2, 0.1 + 0.5 * (1 - 0.1) * (1 + math.cos(x / s1 * math.pi)))
        x -= s1
        return min(0.1 * (1 - (1 - min(x, w2) / w2) ** 2),
                   0.01 + 0.05 * (1 - 0.1) * (1 + math.cos(min(x, total - s1) / (total - s1) * math.pi)))

    for step in [0, 1, 374, 750, 751, 7000, 14999, 15000, 15001, 15150, 15300, 15301, 18000, 20999, 21000]:
        assert two_stage_lr_factor(step, total, s1, w1, 0.1) == pytest.approx(fms(step), abs=1e-12), step
    assert two_stage_lr_factor(15000, total, s1, w1, 0.1) == pytest.approx(0.1)  # stage 1 ends at the floor
    assert two_stage_lr_factor(15001, total, s1, w1, 0.1) < 0.002  # and stage 2 warms up again
    assert two_stage_lr_factor(15300, total, s1, w1, 0.1) == pytest.approx(0.1, rel=1e-2)  # its peak, 10% of stage 1


# -- decoding -----------------------------------------------------------------------------------------


def test_proposals_are_the_training_forward_and_warped_like_p():
    """propose's q_i is softmax(head_i) at the last committed state, reading the drafts themselves
    (train/serve consistency), after start and after commit; warping applies to q as to p."""
    target = tiny_target()
    drafter = speculator(target, n_predict=3, inner_dim=32).eval()
    ids = random_ids(1, 20, seed=2)
    source = drafter.draft_source(target)
    L = 6
    source.start(ids[:, :L], target(ids[:, :L]))
    for accepted in (1, 0, 2):
        proposal = source.propose(ids[:, L: L + 1], 5, SAMPLED, torch.Generator().manual_seed(L))
        assert proposal.tokens.shape == (1, 3) and proposal.probs.shape == (1, 3, VOCAB)  # k capped at n_predict
        seq = torch.cat([ids[:, : L + 1], proposal.tokens], dim=1)
        logits = drafter.speculator(final_hidden(target(seq)), seq)
        for i in range(3):
            assert torch.allclose(proposal.probs[0, i], torch.softmax(logits[i][0, L - 1], -1), rtol=1e-4, atol=1e-7)
        source.commit(ids[:, L: L + 1 + accepted], target(ids[:, : L + 1 + accepted]).slice(slice(L, L + 1 + accepted)))
        L += 1 + accepted
    params = SamplingParams(temperature=0.7, top_k=5)
    q = source.propose(ids[:, L: L + 1], 2, params, torch.Generator().manual_seed(0)).probs[0]
    assert ((q > 0).sum(-1) <= 5).all() and torch.allclose(q.sum(-1), torch.ones(2))
    empty = source.propose(ids[:, L: L + 1], 0, params, None)
    assert empty.tokens.shape == (1, 0) and empty.probs.shape == (1, 0, VOCAB)


def train_on_own_greedy_text(target, prompts, steps, **cfg):
    text = torch.cat([torch.cat([p, torch.tensor([plain_decode(target, p, max_new_tokens=40).tokens])], dim=1)
                      for p in prompts])
    batch = {"input_ids": text, "attention_mask": torch.ones_like(text), "loss_mask": torch.ones_like(text)}
    drafter = speculator(target, **cfg)
    optimizer = torch.optim.AdamW(drafter.trained_module().parameters(), lr=1e-2)
    out = target_outputs(target, batch)
    for _ in range(steps):
        optimizer.zero_grad()
        drafter.compute_loss(batch, out).loss.backward()
        optimizer.step()
    return drafter.eval()


def test_greedy_speculative_decoding_is_greedy_decoding():
    """Through speculative_decode with a speculator that half learned the target's greedy continuations:
    steps accept none, some and all drafts, and every token is the target's greedy token."""
    target = tiny_target()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (1, 6), generator=g) for _ in range(12)]
    drafter = train_on_own_greedy_text(target, prompts, steps=15, n_predict=3, inner_dim=64)  # half-learned
    steps = []
    for prompt in prompts[:6]:
        expected = plain_decode(target, prompt, max_new_tokens=40).tokens
        out = speculative_decode(target, drafter.draft_source(target), prompt, k=3, max_new_tokens=40)
        assert out.tokens == expected
        steps += out.steps
    accepted = [s.num_accepted for s in steps]
    assert sum(accepted) / sum(s.num_drafted for s in steps) >= 0.3
    assert 0 in accepted and 3 in accepted and any(0 < n < 3 for n in accepted)


def test_sampling_at_temperature_1_emits_the_targets_marginals():
    """The decoder's statistical checks (tests/test_decode_statistics.py) on a 16-token target with an
    untrained speculator: its q is unrelated to p, so drafts are accepted and rejected alike."""
    from test_decode_statistics import (
        PROMPT,
        all_checks,
        assert_all_pass,
        assert_both_paths_ran,
        decode_many,
    )

    target = tiny_target(vocab=16, hidden=32, context=64, std=0.5)
    drafter = speculator(target, n_predict=3, inner_dim=32).eval()
    decodes = decode_many(target, lambda: drafter.draft_source(target), SAMPLED, PROMPT, 400, num_tokens=6)
    assert_all_pass(all_checks(decodes, target, SAMPLED))
    assert_both_paths_ran(decodes)


# -- save, load, export ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_gives_identical_logits(tie, tmp_path):
    target = tiny_target()
    drafter = speculator(target, n_predict=3, inner_dim=32, tie_weights=tie, scale_input=tie)
    batch = make_batch()
    optimizer = torch.optim.AdamW(drafter.trained_module().parameters(), lr=3e-3)
    for _ in range(2):
        training_loss(drafter, target, batch).loss.backward()
        optimizer.step()
    drafter.save_pretrained(tmp_path / "d")
    drafter.save_pretrained(tmp_path / "d")  # overwriting a saved drafter is fine
    loaded = load_drafter(tmp_path / "d", target)
    hidden = final_hidden(target_outputs(target, batch))
    for a, b in zip(drafter.speculator(hidden, batch["input_ids"]), loaded.speculator(hidden, batch["input_ids"])):
        assert torch.equal(a, b)
    if tie:  # still tied after loading: one parameter per group
        net = loaded.speculator
        assert net.head[2].weight is net.head[0].weight and net.proj[2].weight is net.proj[1].weight
    assert not any(f.name.startswith(".") for f in tmp_path.iterdir())


# What the consumers read, re-implemented from their source:
#   fms-extras fms_extras/models/hf/modeling_mlp_speculator.py: MLPSpeculatorConfig(vocab_size, emb_dim, inner_dim,
#     n_predict, top_k_tokens_per_head (asserts len == n_predict), n_candidates, tie_weights, scale_input);
#     MLPSpeculatorPreTrainedModel holds MLPSpeculator as `self.speculator`, so from_pretrained reads
#     speculator.{emb,proj,head,ln}.{i}.* for every i, tied or not (fms_extras/models/speculator.py ties by
#     sharing Parameters; its hf adapter strips "speculator." for fms' own get_model).
#   vLLM vllm/model_executor/models/mlp_speculator.py: load_weights looks up name.replace("speculator.", "")
#     in dict(named_parameters()), and skips names it does not know. With tie_weights its ModuleLists
#     repeat one module, so only index 0 of emb/head/ln and proj.0, proj.1 are parameters.
#     vllm/transformers_utils/configs/mlp_speculator.py: the same fields; num_lookahead_tokens = n_predict.
HF_CONFIG_FIELDS = {"vocab_size", "emb_dim", "inner_dim", "n_predict", "top_k_tokens_per_head", "n_candidates",
                    "tie_weights", "scale_input"}


def fms_extras_state_names(config: dict) -> dict[str, tuple]:
    """MLPSpeculatorPreTrainedModel(config).state_dict(): names and shapes."""
    V, E, n = config["vocab_size"], config["emb_dim"], config["n_predict"]
    inner = config["inner_dim"] or E
    names = {}
    for i in range(n):
        names[f"speculator.emb.{i}.weight"] = (V, inner)
        names[f"speculator.proj.{i}.weight"] = (inner, E if i == 0 else inner)
        names[f"speculator.head.{i}.weight"] = (V, inner)
        names[f"speculator.ln.{i}.weight"] = (inner,)
        names[f"speculator.ln.{i}.bias"] = (inner,)
    return names


def vllm_parameters(config: dict) -> dict[str, tuple]:
    """dict(MLPSpeculator(vllm_config).named_parameters()): names and shapes."""
    n = config["n_predict"]  # num_lookahead_tokens
    if not config["tie_weights"]:
        return {name.removeprefix("speculator."): shape for name, shape in fms_extras_state_names(config).items()}
    tied = {name.removeprefix("speculator."): shape for name, shape in fms_extras_state_names(config).items()}
    keep = {"emb.0.weight", "proj.0.weight", "head.0.weight", "ln.0.weight", "ln.0.bias"} | ({"proj.1.weight"} if n > 1 else set())
    return {name: shape for name, shape in tied.items() if name in keep}


def vllm_load(config: dict, tensors: dict) -> dict[str, torch.Tensor]:
    """vLLM's load_weights: every known name lands in its parameter; unknown ones are skipped."""
    params = vllm_parameters(config)
    loaded = {}
    for name, tensor in tensors.items():
        key = name.replace("speculator.", "")
        if key in params:
            assert tuple(tensor.shape) == params[key], name
            loaded[key] = tensor
    assert set(loaded) == set(params), f"vLLM would leave {set(params) - set(loaded)} uninitialised"
    return loaded


def vllm_logits(config: dict, w: dict, hidden: torch.Tensor, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's generate_proposals, with its ModuleLists' tying: head i uses emb/ln/head index 0 and proj
    min(i, 1) when tied."""
    n, E = config["n_predict"], config["emb_dim"]
    inner = config["inner_dim"] or E
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt((1 - state_weight**2) * (inner / 2))
    state = rms(hidden) / math.sqrt(2) if config["scale_input"] else hidden
    out = []
    for i, token in enumerate(tokens):
        j, p = (0, min(i, 1)) if config["tie_weights"] else (i, i)
        state = state @ w[f"proj.{p}.weight"].T + (emb_weight / state_weight) * w[f"emb.{j}.weight"][token]
        state = gelu(rms(state, w[f"ln.{j}.weight"], w[f"ln.{j}.bias"]))
        out.append(state @ w[f"head.{j}.weight"].T)
    return out


@pytest.mark.parametrize("fmt", ["hf", "vllm"])
@pytest.mark.parametrize("tie", [False, True])
def test_export_is_what_fms_extras_and_vllm_load(tie, fmt, tmp_path):
    """Both formats are fms-extras' Hugging Face folder (the vLLM one also carries specdraft.json, which
    engines ignore): the names and fields the loaders read, logits through vLLM's mapping, and back."""
    from specdraft.export import export, load_exported

    target = tiny_target()
    drafter = speculator(target, n_predict=3, inner_dim=32, tie_weights=tie, scale_input=tie)
    drafter.save_pretrained(tmp_path / "d")
    out = export(tmp_path / "d", fmt, tmp_path / "export")
    assert (out / "specdraft.json").is_file() == (fmt == "vllm")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert config["architectures"] == ["MLPSpeculatorPreTrainedModel"] and config["model_type"] == "mlp_speculator"
    assert HF_CONFIG_FIELDS <= set(config)  # every field written, none left to a loader's default
    assert config == {**config, "vocab_size": VOCAB, "emb_dim": 64, "inner_dim": 32, "n_predict": 3,
                      "top_k_tokens_per_head": [5, 4, 3], "n_candidates": 5, "tie_weights": tie, "scale_input": tie}
    # fms-extras: exactly its state_dict's names and shapes
    assert {name: tuple(t.shape) for name, t in tensors.items()} == fms_extras_state_names(config)
    # vLLM: every parameter filled; the logits through its mapping are the drafter's
    weights = vllm_load(config, tensors)
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    tokens = [random_ids(2, 5, seed=10 + i) for i in range(3)]
    ours = reference_heads(drafter.speculator, hidden, tokens)  # == drafter's own, test_heads_match_the_equations
    for a, b in zip(ours, vllm_logits(config, weights, hidden, tokens)):
        assert torch.equal(a, b)
    # and it reads back into specdraft with identical logits
    loaded = load_exported(out, target)
    ids = random_ids(2, 5, seed=3)
    for a, b in zip(drafter.speculator(hidden, ids), loaded.speculator(hidden, ids)):
        assert torch.equal(a, b)


def test_registered_with_the_vllm_format_and_its_honest_serve_hint(tmp_path, capsys):
    from specdraft.cli import main
    from specdraft.export import exporters_of

    assert FAMILIES["mlp_speculator"] is MLP_SPECULATOR
    assert sorted(exporters_of("mlp_speculator")) == ["hf", "vllm"]
    speculator(tiny_target(), n_predict=2, inner_dim=32).save_pretrained(tmp_path / "d")
    assert main(["export", str(tmp_path / "d"), "--format", "vllm", "--out", str(tmp_path / "v"),
                 "--target", "my/target"]) == 0
    printed = capsys.readouterr().out
    assert "V1 engine does not route mlp_speculator" in printed and "#47825" in printed
    assert f'"model": "{tmp_path / "v"}"' in printed and "vllm serve my/target" in printed
    assert '"num_speculative_tokens": 2}' in printed  # its n_predict


def test_a_changed_export_is_refused(tmp_path):
    target = tiny_target()
    speculator(target, n_predict=2, inner_dim=32, tie_weights=True).save_pretrained(tmp_path / "d")
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    tensors["speculator.head.1.weight"] = tensors["speculator.head.1.weight"] + 1  # tied copies disagree
    save_file(tensors, tmp_path / "d" / "model.safetensors")
    with pytest.raises(SpecdraftError, match="tie_weights but different values"):
        load_drafter(tmp_path / "d", target)
    del tensors["speculator.head.1.weight"]
    save_file(tensors, tmp_path / "d" / "model.safetensors")
    with pytest.raises(SpecdraftError, match="missing.*speculator.head.1.weight"):
        load_drafter(tmp_path / "d", target)


def test_loading_onto_another_target_is_refused(tmp_path):
    speculator(tiny_target(), n_predict=2, inner_dim=32).save_pretrained(tmp_path / "d")
    with pytest.raises(SpecdraftError, match="emb_dim=64"):
        load_drafter(tmp_path / "d", tiny_target(hidden=32))
    with pytest.raises(SpecdraftError, match="vocab_size=256"):
        load_drafter(tmp_path / "d", tiny_target(vocab=300))


# -- recipes at real dimensions ------------------------------------------------------------------------------


def expected_parameters(cfg, H, V):
    """fms-extras MLPSpeculator's parameter count, by hand."""
    inner, n = cfg.inner_dim or H, cfg.n_predict
    if cfg.tie_weights:  # one emb, head and LN; proj_0, and proj_1 shared by the rest
        return 2 * V * inner + H * inner + inner * inner + 2 * inner
    return n * (2 * V * inner + 2 * inner) + H * inner + (n - 1) * inner * inner


MLP_RECIPES = sorted(RECIPES.glob("*mlp_speculator.yaml"))


def test_the_recipes_are_shipped_under_the_bench_naming():
    names = {p.name for p in MLP_RECIPES}
    assert names == {"toy_mlp_speculator.yaml", "smollm2-135m-mlp_speculator.yaml", "llama3.1-8b-mlp_speculator.yaml"}


@pytest.mark.parametrize("path", MLP_RECIPES, ids=lambda p: p.name)
def test_every_recipe_builds_at_real_dimensions(path):
    from test_config import recipe_on_meta

    recipe, config, target = recipe_on_meta(path, "mlp_speculator")
    drafter = get_family("mlp_speculator").build(target, recipe.drafter, None)
    count = sum(p.numel() for p in drafter.trained_module().parameters())
    assert count == expected_parameters(recipe.drafter, config.hidden_size, config.vocab_size)
    assert recipe.eval.k == recipe.drafter.n_predict  # every evaluated draft has a head
    # fms-fsdp's optimizer where the recipe says nothing else
    assert recipe.optimizer.betas == [0.9, 0.95] and recipe.optimizer.weight_decay == pytest.approx(0.1)
    assert recipe.training.max_grad_norm == pytest.approx(1.0)
    if recipe.drafter.stage2_start_step is not None:
        assert 0 < recipe.drafter.stage2_start_step < recipe.training.max_steps


def test_llama_8b_recipe_is_ibms_llama3_8b_speculator():
    """fms-extras registers llama.llama3.8b.3_2b: emb 4096, vocab 128256, 4 heads of width 3072, untied:
    3.2B parameters."""
    recipe = load_recipe(RECIPES / "llama3.1-8b-mlp_speculator.yaml")
    cfg = recipe.drafter
    assert (cfg.n_predict, cfg.inner_dim, cfg.tie_weights, cfg.scale_input) == (4, 3072, False, False)
    assert expected_parameters(cfg, 4096, 128256) == 3_192_938_496


# -- training through `specdraft train`: stage 1, the switch, stage 2, kill -9 and resume ------------------

# The speculator has no noise of its own: only stage 2's sampling draws random numbers. The kill lands
# in stage 2, after checkpoints at step 3 (stage 1) and 6 (stage 2, after some sampling): resuming from
# 6 needs the RNG state restored, resuming from 3 crosses the switch.
TRAIN_STEPS, STAGE2_START, SAVE_EVERY, KILL_AT_STEP = 9, 4, 3, 8
TRAIN_DRAFTER = {"family": "mlp_speculator", "n_predict": 2, "inner_dim": 32, "stage2_start_step": STAGE2_START,
                 "stage2_prompt_length": 8, "stage2_new_tokens": 6, "stage2_prompts_per_row": 2}
# The specdraft CLI (tests/run_probe_train.py, which also applies PROBE_MUTANT) with a kill -9 at the
def test_stage2_labels_stop_at_the_targets_first_end_of_sequence(monkeypatch):
    """The target's first end-of-sequence token in a continuation is its last label; states from it on read nothing."""
    target = tiny_target()
    cfg = MLPSpeculatorConfig(n_predict=2, inner_dim=32, stage2_start_step=0, stage2_prompt_length=5,
                              stage2_new_tokens=12, stage2_prompts_per_row=2)
    batch = make_batch(B=2, T=12)
    monkeypatch.setattr(FrozenTarget, "stop_token_ids", lambda self: [])
    torch.manual_seed(0)
    endless, _ = stage2_batch(target, batch, cfg)
    ids, P = endless["input_ids"], 5
    assert endless["loss_mask"][:, P:].all()
    # a stop token: row 0's 4th generated token, where it first appears there
    stop = next(t for t in range(P, ids.shape[1]) if t >= P + 3 and ids[0, t] not in ids[0, P:t])
    monkeypatch.setattr(FrozenTarget, "stop_token_ids", lambda self: [int(ids[0, stop])])
    torch.manual_seed(0)
    generated, _ = stage2_batch(target, batch, cfg)
    assert torch.equal(generated["input_ids"], ids)  # the same draws: only the masks differ
    for row in range(ids.shape[0]):
        hits = (ids[row, P:] == ids[0, stop]).nonzero().flatten()
        end = P + int(hits[0]) if hits.numel() else ids.shape[1]
        assert generated["loss_mask"][row].nonzero().flatten().tolist() == list(range(P, min(end + 1, ids.shape[1])))
        assert generated["state_mask"][row].nonzero().flatten().tolist() == list(range(P - 1, end))
    masks = head_masks(generated["state_mask"], generated["loss_mask"], 2)
    assert [m[0].nonzero().flatten().max().item() + i + 2 for i, m in enumerate(masks)] == [stop, stop]
    # the stage-2 default is the target's own: the tiny Llama's generation config ends on id 2
    monkeypatch.undo()
    assert target.stop_token_ids() == [2]


# PROBE_KILL_AT_CALL-th training loss of the speculator, as the probe family does for its own.
KILL_HOOK = """
import os, runpy, signal, sys
from specdraft.drafters.mlp_speculator import MLPSpeculator
real, calls = MLPSpeculator.compute_loss, [0]
def compute_loss(self, *args, **kwargs):
    if self.training:
        calls[0] += 1
        if calls[0] == int(os.environ.get("PROBE_KILL_AT_CALL", 0)):
            os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *args, **kwargs)
MLPSpeculator.compute_loss = compute_loss
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def mlp_killed_run(folder: Path):
    from spine import KilledRun, make_recipe

    recipe = make_recipe(folder, folder / "target", folder / "chat.jsonl", training={"max_steps": TRAIN_STEPS},
                         checkpoint={"save_every": SAVE_EVERY})
    recipe["drafter"] = dict(TRAIN_DRAFTER)
    accumulation = recipe["training"]["grad_accumulation"]
    return KilledRun(folder, recipe, kill_at_call=(KILL_AT_STEP - 1) * accumulation + 1, checkpoint_step=6,
                     launcher=lambda: [sys.executable, "-c", KILL_HOOK])


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory):
    from spine import built_killed_run

    return built_killed_run(tmp_path_factory, "mlp-kill-9", mlp_killed_run)


def test_training_switches_to_stage_2_on_fms_fsdps_schedule(mlp_runs):
    from spine import read_metrics

    metrics = [m for m in read_metrics(mlp_runs.straight) if "train/loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, TRAIN_STEPS + 1))
    assert [m["train/stage"] for m in metrics] == [1.0] * STAGE2_START + [2.0] * (TRAIN_STEPS - STAGE2_START)
    o = mlp_runs.recipe["optimizer"]
    for m in metrics:  # train/lr after step s: the lr step s + 1 uses
        factor = two_stage_lr_factor(m["step"], TRAIN_STEPS, STAGE2_START, o["warmup_steps"], 0.1)
        assert m["train/lr"] == pytest.approx(o["lr"] * factor, rel=1e-9), m["step"]


def test_a_kill_9_in_stage_2_resumes_exactly(mlp_runs):
    """From the step-6 checkpoint: the stage-2 continuations after it come from the restored RNG."""
    mlp_runs.check_resume("resumed")


def test_a_resume_that_loses_the_rng_is_caught(mlp_runs):
    from spine import drafter_weights

    out, run_dir = mlp_runs.resume("no-rng", env={"PROBE_MUTANT": "skip_rng_restore"})
    assert out.returncode == 0, out.stderr[-3000:]
    straight, mutant = drafter_weights(mlp_runs.straight), drafter_weights(run_dir)
    assert any(not torch.equal(straight[name], mutant[name]) for name in straight), \
        "stage 2 drew the same samples without the checkpoint's RNG: the resume check would not see a lost RNG"


def test_a_resume_from_stage_1_crosses_the_switch_exactly(mlp_runs):
    """Without the step-6 checkpoint the resume starts at step 3, in stage 1, and switches at step 4."""
    import shutil

    from spine import assert_resumed_exactly, run_cli, write_recipe

    run_dir = mlp_runs.tmp / "from-stage-1" / "run"
    shutil.copytree(mlp_runs.killed, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-0000006")
    recipe = json.loads(json.dumps(mlp_runs.recipe))
    recipe["checkpoint"]["output_dir"] = str(run_dir)
    path = write_recipe(mlp_runs.tmp / "from-stage-1.yaml", recipe)
    out = run_cli(["train", str(path), "--no-progress", "--resume"], launcher=[sys.executable, "-c", KILL_HOOK],
                  timeout=900)
    assert out.returncode == 0, out.stderr[-5000:]
    assert_resumed_exactly(mlp_runs.straight, run_dir, out.stdout + out.stderr, 3, TRAIN_STEPS)


# -- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: MLPSpeculatorConfig(n_predict=0), "n_predict must be an integer >= 1"),
    (lambda: MLPSpeculatorConfig(n_predict=-2), "n_predict must be an integer >= 1"),
    (lambda: MLPSpeculatorConfig(n_predict=1, tie_weights=True), "tie_weights shares weights between heads.*n_predict is 1"),
    (lambda: MLPSpeculatorConfig(stage2_new_tokens=64), "stage2_new_tokens is a stage-2 setting.*stage2_start_step is not set"),
    (lambda: MLPSpeculatorConfig(stage2_top_k=5), "stage2_top_k is a stage-2 setting"),
    (lambda: MLPSpeculatorConfig(head_weights=[1.0, 1.0]), "head_weights needs one weight >= 0 per head \\(3\\)"),
    (lambda: MLPSpeculatorConfig(head_weights=[0.0, 0.0, 0.0]), "not all 0"),
    (lambda: MLPSpeculatorConfig(n_predict=4, top_k_tokens_per_head=[5, 4, 3]), "top_k_tokens_per_head needs one integer"),
    (lambda: MLPSpeculatorConfig(n_candidates=61), "n_candidates must be between 1 and the tree's 60"),
    (lambda: MLPSpeculatorConfig(stage2_start_step=10, stage2_new_tokens=3), "leaves head 2 no generated label"),
    (lambda: MLPSpeculatorConfig(inner_dim=-1), "inner_dim must be >= 0"),
])
def test_bad_config_values(make, match):
    with pytest.raises(SpecdraftError, match=match):
        make()


def test_a_stage2_setting_without_a_start_in_a_recipe_names_the_key():
    raw = {"target": {"path": "x"}, "drafter": {"family": "mlp_speculator", "stage2_prompt_length": 32},
           "data": {"path": "d.jsonl"}, "training": {"max_steps": 10}, "checkpoint": {"output_dir": "r"}}
    with pytest.raises(SpecdraftError, match="stage2_prompt_length is a stage-2 setting.*set stage2_start_step"):
        parse_recipe(raw)


def test_a_stage2_generation_longer_than_the_context_is_refused():
    target = tiny_target(context=64)
    cfg = MLPSpeculatorConfig(stage2_start_step=5, stage2_prompt_length=16, stage2_new_tokens=49)
    with pytest.raises(SpecdraftError, match="16 \\+ 49 = 65 tokens, longer than the target's context of 64"):
        build_mlp_speculator(target, cfg)
    build_mlp_speculator(target, MLPSpeculatorConfig(stage2_start_step=5, stage2_prompt_length=16, stage2_new_tokens=48))


def test_a_target_without_a_final_hidden_state_is_refused():
    target = tiny_target()
    drafter = speculator(target, n_predict=2, inner_dim=32)
    batch = make_batch()
    no_hidden = TargetOutputs(logits=target.forward_batch(batch).logits)
    with pytest.raises(SpecdraftError, match="reads the target's final hidden state"):
        drafter.compute_loss(batch, no_hidden)
    with pytest.raises(SpecdraftError, match="reads the target's final hidden state"):
        drafter.draft_source(target).start(batch["input_ids"][:1], no_hidden)
    # A target built without it computes it once a speculator is built on it (FrozenTarget.require).
    bare = FrozenTarget.from_config(target.config, device="cpu")
    assert bare(batch["input_ids"]).final_hidden is None
    build_mlp_speculator(bare, MLPSpeculatorConfig(n_predict=2, inner_dim=32))
    assert bare.needs.final_hidden and bare(batch["input_ids"]).final_hidden is not None


def test_a_draft_vocabulary_is_refused():
    with pytest.raises(SpecdraftError, match="whole vocabulary"):
        build_mlp_speculator(tiny_target(), MLPSpeculatorConfig(), draft_vocab=object())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_greedy_proposal_is_the_argmax_chain_and_forms_no_q():
    target = tiny_target()
    drafter = speculator(target, n_predict=3, inner_dim=32).eval()
    ids = random_ids(1, 12, seed=4)
    greedy, sampled = drafter.draft_source(target), drafter.draft_source(target)
    for source in (greedy, sampled):
        source.start(ids[:, :8], target(ids[:, :8]))
    proposal = greedy.propose(ids[:, 8:9], 3, SamplingParams(temperature=0.0), None)
    assert proposal.probs is None and proposal.tokens.shape == (1, 3)
    # each greedy draft is the argmax of the head's distribution given the drafts before it
    seq = torch.cat([ids[:, :9], proposal.tokens], dim=1)
    logits = drafter.speculator(final_hidden(target(seq)), seq)
    assert [int(logits[i][0, 7].argmax()) for i in range(3)] == proposal.tokens[0].tolist()


@pytest.mark.parametrize("loss", ["ce", "tvd"])
def test_the_heads_run_over_counted_positions_only_with_the_dense_loss_and_gradients(loss):
    # Issue 35: every head's vocabulary projection (and the loss over the vocabulary) ran at every position of
    # the packed rows, the prompts' tokens and the padding included. The states now run where some head counts
    # and each head's projection where it counts: the same loss and gradients as the dense reference.
    target = tiny_target()
    drafter = speculator(target, n_predict=3, inner_dim=32, loss=loss)
    T = 24
    ids = random_ids(2, T, seed=5)
    attention, loss_mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    seq_ids = torch.full((2, T), -1)
    for b, docs in enumerate([[(5, 7), (3, 7)], [(7, 11)]]):  # (prompt, answer) per packed conversation
        start = 0
        for d, (prompt, answer) in enumerate(docs):
            end = start + prompt + answer
            attention[b, start:end], loss_mask[b, start + prompt : end], seq_ids[b, start:end] = 1, 1, d
            start = end
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "seq_ids": seq_ids}
    out_target = target.forward_batch(batch, logits="full" if loss != "ce" else "none")
    fed = []
    hooks = [head.register_forward_hook(lambda module, args, out: fed.append(args[0][..., 0].numel()))
             for head in drafter.speculator.head]
    try:
        out = drafter.compute_loss(batch, out_target)
    finally:
        for hook in hooks:
            hook.remove()
    out.loss.backward()
    gathered = {n: p.grad.clone() for n, p in drafter.trained_module().named_parameters() if p.grad is not None}
    drafter.zero_grad()

    masks = head_masks(attention.bool(), (attention & loss_mask).bool(), 3, seq_ids)
    assert fed == [int(mask.sum()) for mask in masks] and sum(fed) < 0.6 * 3 * 2 * T  # rows the heads fed
    logits = drafter.speculator(final_hidden(out_target), ids)
    per_head = (per_head_cross_entropy(logits, ids, masks) if loss == "ce" else
                per_head_soft_loss(logits, torch.softmax(out_target.logits.float(), -1), masks, DRAFTER_LOSSES[loss]))
    dense = sum(per_head)
    dense.backward()
    assert_close(out.loss, dense)
    assert gathered.keys() == {n for n, p in drafter.trained_module().named_parameters() if p.grad is not None}
    for name, grad in gathered.items():
        assert_close(grad, drafter.trained_module().get_parameter(name).grad, what=name)
