"""Sequence-level unlikelihood fine-tuning: teach a small LM not to loop under greedy decoding.

Maximum likelihood alone leaves small models with greedy continuations that fall into
loops ("import sys\\nimport sys\\n..."): once a phrase repeats, its probability rises with
every repeat (Xu et al. 2022, "Learning to Break the Loop", sec. 3). Welleck et al. 2020
("Neural Text Generation with Unlikelihood Training", sec. 5.2) fix it where it happens:
decode greedily from training prefixes, find the tokens that belong to an n-gram the
continuation already produced, and push their probability down with

    L_UL-seq = - sum_t sum_{c in C_t} log(1 - p(c | x_<t)),   C_t = {x_t} if x_t is in a repeated n-gram

alternating these updates with ordinary MLE updates on the training data so the model
keeps its likelihood (and, here, adding the MLE loss of each prompt's true continuation to
its UL update; see unlikelihood_finetune). The toy target's last build phase runs this
(`--unlikelihood-steps`).
"""

import random
import time

import torch
from tqdm import tqdm


def repeated_ngram_mask(tokens: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """[B, L] bool: True at every token of an n-gram that already started earlier in the same
    row (Welleck et al. 2020, eq. 6's candidate set). Only `valid` tokens count."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for row in range(tokens.shape[0]):
        ids = tokens[row, : int(valid[row].sum())].tolist()  # valid is a prefix of each row
        seen = set()
        for start in range(len(ids) - n + 1):
            gram = tuple(ids[start : start + n])
            if gram in seen:
                mask[row, start : start + n] = True
            seen.add(gram)
    return mask


def unlikelihood_loss(logits: torch.Tensor, targets: torch.Tensor, penalize: torch.Tensor, normalizer) -> torch.Tensor:
    """Welleck et al. 2020, eq. 5 with C_t = {x_t} where `penalize`: -sum log(1 - p(x_t | x_<t)),
    divided by `normalizer` (the number of continuation tokens, as fairseq's implementation does).
    1 - p is clamped at 1e-5 so a token the model is sure of gives a large but finite loss."""
    prob = logits.float().softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -(torch.log((1 - prob).clamp_min(1e-5)) * penalize).sum() / normalizer


def sample_windows(rows: torch.Tensor, file_starts: torch.Tensor, count: int, prefix_len: int, window_len: int, *,
                   assistant_id: int, rng: random.Random) -> torch.Tensor:
    """[count, window_len] stretches of training text whose first `prefix_len` tokens are a
    prompt, in turn: the start of a plain file (a row of `file_starts`), a chat prompt cut from
    the packed rows (ending on `<|assistant|>`, so the answer follows), and any position of the
    rows; the ways a target is prompted. A kind that is missing falls back to any position.
    The rest of each window is the true continuation, the MLE anchor of the UL step.

    File starts are passed in, not found after each eos in the rows: there most samples are
    chats, and the eos also closes every user turn, so "after an eos" is nearly always chat."""
    width = rows.shape[1]
    chat_ends = [(r, i + 1 - prefix_len) for r, i in (rows == assistant_id).nonzero().tolist()
                 if i + 1 >= prefix_len and i + 1 - prefix_len + window_len <= width]
    if file_starts.shape[-1] < window_len:
        file_starts = file_starts[:0]
    windows = []
    for k in range(count):
        if k % 3 == 0 and len(file_starts):
            windows.append(file_starts[rng.randrange(len(file_starts)), :window_len])
            continue
        if k % 3 == 1 and chat_ends:
            r, begin = chat_ends[rng.randrange(len(chat_ends))]
        else:
            r, begin = rng.randrange(rows.shape[0]), rng.randrange(width - window_len + 1)
        windows.append(rows[r, begin : begin + window_len])
    return torch.stack(windows)


@torch.no_grad()
def greedy_continuations(model, prefixes: torch.Tensor, new_tokens: int, eos_id: int, pad_id: int):
    """Greedy continuations [B, new_tokens] and their valid mask (up to and including eos)."""
    model.eval()
    out = model.generate(prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=pad_id)
    cont = out[:, prefixes.shape[1]:]
    cont = torch.nn.functional.pad(cont, (0, new_tokens - cont.shape[1]), value=pad_id)
    ended = (cont == eos_id).long().cumsum(1)
    valid = (ended == 0) | ((ended == 1) & (cont == eos_id))  # tokens before the first eos, and the eos
    return cont, valid


def adamw_without_norm_decay(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW(betas 0.9, 0.95) with weight decay on matrices only, not on norms (the toy target's optimizer)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )


def _recent_mean(values: list[float], window: int = 25) -> float:
    recent = values[-window:]
    return sum(recent) / max(len(recent), 1)


def unlikelihood_finetune(model, rows: torch.Tensor, file_starts: torch.Tensor, *, steps: int, lr: float,
                          weight_decay: float, batch_size: int,
                          prefix_len: int, new_tokens: int, ngram: int, eos_id: int, pad_id: int, assistant_id: int,
                          seed: int, log) -> dict:
    """Alternate UL-seq updates (even steps) with MLE updates on packed rows (odd steps), as
    Welleck et al. mix them with probability 0.5; deterministic given seed. Returns stats.

    Each UL step also takes the MLE loss of its prompts' true continuations. Without that
    anchor the probability UL removes from a looping token can go anywhere; at plain file
    starts, rare in the packed rows' MLE, it went to junk bytes (greedy output stopped
    looping and stopped being text)."""
    rng = random.Random(seed)
    optimizer = adamw_without_norm_decay(model, lr, weight_decay)
    order = list(range(rows.shape[0]))
    rng.shuffle(order)
    cursor, start = 0, time.time()
    repeat_rates, ul_losses, anchor_losses, mle_losses = [], [], [], []
    bar = tqdm(total=steps, desc="unlikelihood", unit="step", dynamic_ncols=True)
    decay_start = steps - steps // 4
    device_type = "cuda" if rows.is_cuda else "cpu"
    for step in range(steps):
        # Constant lr, then a linear anneal to 0.1x over the last quarter (as pretraining's WSD ends).
        done = max(step - decay_start, 0) / max(steps - decay_start, 1)
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - 0.9 * done)
        if step % 2 == 0:
            windows = sample_windows(rows, file_starts, batch_size, prefix_len, prefix_len + new_tokens,
                                     assistant_id=assistant_id, rng=rng)
            prefixes, truth = windows[:, :prefix_len], windows[:, prefix_len:]
            cont, valid = greedy_continuations(model, prefixes, new_tokens, eos_id, pad_id)
            penalize = repeated_ngram_mask(cont, valid, ngram)
            num_valid = max(valid.sum().item(), 1)
            repeat_rates.append(penalize.sum().item() / num_valid)
            model.train()
            own = torch.cat([prefixes, cont], 1)
            with torch.autocast(device_type, dtype=torch.bfloat16):  # own continuations and true ones in one forward
                logits = model(input_ids=torch.cat([own, windows])).logits[:, prefix_len - 1 : -1]
            own_logits, true_logits = logits.chunk(2)
            ul = unlikelihood_loss(own_logits, cont, penalize, num_valid)
            anchor = torch.nn.functional.cross_entropy(true_logits.float().flatten(0, 1), truth.flatten())
            loss = ul + anchor
            anchor_losses.append(anchor.item())
            ul_losses.append(ul.item())
        else:
            if cursor + batch_size > len(order):
                rng.shuffle(order)
                cursor = 0
            batch = rows[order[cursor : cursor + batch_size]]
            cursor += batch_size
            model.train()
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = model(input_ids=batch, labels=batch).loss
            mle_losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        if repeat_rates and mle_losses:
            bar.set_postfix(repeats=f"{_recent_mean(repeat_rates):.3f}", mle=f"{_recent_mean(mle_losses):.3f}")
        if (step + 1) % 50 == 0:
            log(f"unlikelihood step {step + 1}: repeated-{ngram}-gram share of own greedy tokens "
                f"{_recent_mean(repeat_rates):.4f}, ul loss {_recent_mean(ul_losses):.4f}, anchor loss "
                f"{_recent_mean(anchor_losses):.4f}, mle loss "
                f"{_recent_mean(mle_losses):.4f}, elapsed {time.time() - start:.0f}s")
    bar.close()
    model.eval()
    return {
        "unlikelihood_steps": steps,
        "unlikelihood_seconds": round(time.time() - start, 1),
        "repeat_share_first": _recent_mean(repeat_rates[:25]),
        "repeat_share_last": _recent_mean(repeat_rates),
        "final_mle_loss": _recent_mean(mle_losses),
        "final_anchor_loss": _recent_mean(anchor_losses),
    }
