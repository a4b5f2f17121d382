"""A small Llama trained on the standard library's own Python source.

No model hub is reachable on many machines, so specdraft ships a real target
that needs no download: `toy_target_path()` is the checkpoint in
`specdraft/assets/toy_target/` and `build_toy_target()` (CLI: `specdraft
toy-target`) is the exact recipe that produced it.

The recipe, top to bottom:
  1. list the interpreter's stdlib `.py` files, minus tests and generated tables,
     and hold out ~5% of them *by file* (hash of the relative path), so held-out
     loss measures generalisation to unseen modules, not unseen lines;
  2. train a byte-level BPE on the training files only;
  3. turn every training file into one plain document or one chat sample
     ("Write the module `x.py`" -> the file), plus one chat sample per function,
     class and method ("Write the function `f` in `x.py`" -> its source), so the
     chat template means something and answers end with `<|end|>`;
  4. pack the shuffled samples into fixed-length rows and train a Llama
     (GQA, tied embeddings, bf16 autocast, AdamW, warmup-stable-decay lr);
  5. optionally (`--unlikelihood-steps`; the shipped build used it) fine-tune
     with sequence-level unlikelihood against greedy loops (specdraft/toy_build/unlikelihood.py);
  6. save a normal transformers folder in bf16, then reload it and measure
     held-out loss and how often greedy continuations fall into loops (or into junk bytes).
"""

import argparse
import ast
import dataclasses
import hashlib
import json
import pathlib
import random
import shutil
import sys
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specdraft.atomic import atomic_folder, check_replaceable_output
from specdraft.errors import SpecdraftError
from specdraft.toy_build.unlikelihood import (
    adamw_without_norm_decay,
    unlikelihood_finetune,
)
from specdraft.toy_target import (
    definition_prompts,
    is_heldout,
    list_source_files,
)

# --------------------------------------------------------------------------- chat format

END = "<|end|>"  # ends every document and every chat turn; the eos token
PAD = "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [END, PAD, *ROLE_TOKENS]

# Renders `<|role|>\n{content}<|end|>\n` per turn. The assistant's content and its
# <|end|> sit inside {% generation %} so `apply_chat_template(...,
# return_assistant_tokens_mask=True)` can mark exactly the tokens a model must learn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\n' }}{% generation %}{{- message['content'] + '<|end|>' }}{% endgeneration %}{{- '\n' }}"
    "{%- elif message['role'] in ['system', 'user'] %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- else %}"
    "{{- raise_exception('toy target chat roles are system, user and assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"
)

TOY_TARGET_OWNER = "specdraft toy-target"  # atomic.mark_owner: --overwrite replaces only its own builds


def render_chat(user: str, assistant: str) -> str:
    """The string CHAT_TEMPLATE renders for one exchange (used to build training text)."""
    return f"<|user|>\n{user}{END}\n<|assistant|>\n{assistant}{END}\n"


# --------------------------------------------------------------------------- corpus

def split_files(files: dict[str, str], heldout_percent: float) -> tuple[dict[str, str], dict[str, str]]:
    train = {rel: text for rel, text in files.items() if not is_heldout(rel, heldout_percent)}
    heldout = {rel: text for rel, text in files.items() if is_heldout(rel, heldout_percent)}
    if not train or not heldout:
        raise SpecdraftError(
            f"the {heldout_percent}% held-out split of {len(files)} files left an empty side; "
            "use more files (--max-files) or a different --heldout-percent"
        )
    return train, heldout


def training_texts(files: dict[str, str], chat_fraction: float, rng: random.Random) -> list[str]:
    """Each file once (plain, or as a 'write the module' chat answer), plus its definitions as chat."""
    texts = []
    for rel, text in files.items():
        if rng.random() < chat_fraction:
            texts.append(render_chat(f"Write the module `{rel}`.", text))
        else:
            texts.append(text + END)
        texts.extend(render_chat(prompt, source) for prompt, source in definition_prompts(rel, text))
    return texts


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer keeps indentation runs as tokens)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk>
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=END,
        pad_token=PAD,
        extra_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------- model and training


@dataclasses.dataclass
class ToyRecipe:
    """Everything that shapes the toy target. The CLI exposes each field as a flag."""

    vocab_size: int = 2048
    hidden_size: int = 192
    num_layers: int = 8  # >= 7 so EAGLE-3 taps (2, N//2, N-3) are distinct layers
    num_heads: int = 6
    num_kv_heads: int = 2  # GQA: smaller KV cache, fewer params
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    seq_len: int = 512
    batch_size: int = 4  # small batches: more updates from the few tokens a CPU hour gives
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    decay_fraction: float = 0.25  # WSD: the last quarter of the steps anneals the lr
    weight_decay: float = 0.1
    chat_fraction: float = 0.5  # share of whole files rendered as 'write the module' chats
    heldout_percent: float = 5.0
    max_files: int = 0  # 0 = all; tests use a handful
    eval_prompts: int = 16  # held-out prompts of each kind for the loop measure
    eval_new_tokens: int = 128
    threads: int = 1  # the build shares small machines; 1 thread degrades gracefully
    # Last phase: sequence-level unlikelihood fine-tuning against greedy loops (specdraft/toy_build/unlikelihood.py).
    unlikelihood_steps: int = 0  # half UL-seq (+ MLE anchor) updates on own greedy continuations, half MLE; shipped: 1600
    ul_lr: float = 3e-4  # held, then annealed to 0.1x over the last quarter (1e-3 cost 0.1 nats more held-out loss)
    ul_batch_size: int = 8
    ul_prefix_len: int = 64
    ul_new_tokens: int = 128
    ul_ngram: int = 4  # Welleck et al. 2020 penalize repeated 4-grams


# Fields that do not change what pretraining computes (--init-from may differ in these).
NOT_PRETRAINING = {"threads", "eval_prompts", "eval_new_tokens", "unlikelihood_steps", "ul_lr", "ul_batch_size",
                   "ul_prefix_len", "ul_new_tokens", "ul_ngram"}


def make_model(recipe: ToyRecipe, tokenizer):
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,  # the embedding is ~10% of the params; share it with the head
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def packed_rows(token_lists: list[list[int]], seq_len: int, rng: random.Random) -> torch.Tensor:
    """Shuffle whole samples, concatenate, cut into [rows, seq_len] (the tail is dropped)."""
    order = list(range(len(token_lists)))
    rng.shuffle(order)
    flat = torch.tensor([t for i in order for t in token_lists[i]], dtype=torch.long)
    rows = len(flat) // seq_len
    return flat[: rows * seq_len].view(rows, seq_len)


def plain_file_starts(token_lists: list[list[int]], user_id: int, length: int) -> torch.Tensor:
    """[N, length]: the first tokens of every sample that is a plain file (chat samples start with <|user|>)."""
    starts = [ids[:length] for ids in token_lists if ids and ids[0] != user_id and len(ids) >= length]
    return torch.tensor(starts, dtype=torch.long).view(-1, length)


def lr_at(step: int, total_steps: int | None, recipe: ToyRecipe) -> float:
    """Warmup-stable-decay (MiniCPM, Hu et al. 2024, sec. 4): linear warmup, constant lr,
    then a linear decay to min_lr_ratio * lr over the last decay_fraction of the steps.
    Until the decay begins the lr does not depend on the run length, so a run can be
    bounded by wall time and still be replayed exactly with --steps."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    if total_steps is None:
        return recipe.lr
    decay_start = decay_start_step(total_steps, recipe)
    if step < decay_start:
        return recipe.lr
    done = (step - decay_start) / max(total_steps - decay_start, 1)
    return recipe.lr * (1 - (1 - recipe.min_lr_ratio) * done)


def decay_start_step(total_steps: int, recipe: ToyRecipe) -> int:
    return total_steps - round(total_steps * recipe.decay_fraction)


def total_steps_from(step: int, recipe: ToyRecipe) -> int:
    """The smallest run length whose decay starts at or after `step` (for --minutes)."""
    total = step
    while decay_start_step(total, recipe) < step:
        total += 1
    return total


def train(model, token_lists, recipe: ToyRecipe, *, steps: int | None, minutes: float | None, seed: int, log):
    """AdamW on packed rows, deterministic given seed and steps. With `minutes`, the
    stable phase runs until (1 - decay_fraction) of the time is used, then the step
    count is fixed; `--steps <logged steps>` replays the same schedule."""
    rng = random.Random(seed)
    optimizer = adamw_without_norm_decay(model, recipe.lr, recipe.weight_decay)
    rows, cursor, epoch = packed_rows(token_lists, recipe.seq_len, rng), 0, 0
    total_steps = steps
    start, step, smooth = time.time(), 0, None
    bar = tqdm(total=total_steps, desc="toy-target", unit="step", dynamic_ncols=True)
    model.train()
    while total_steps is None or step < total_steps:
        if total_steps is None and time.time() - start >= (1 - recipe.decay_fraction) * minutes * 60:
            total_steps = total_steps_from(step, recipe)
            bar.total = total_steps
            log(f"step {step}: {minutes} min budget -> {total_steps} steps (replay with --steps {total_steps})")
        if cursor + recipe.batch_size > len(rows):  # new epoch: reshuffle and repack
            rows, cursor, epoch = packed_rows(token_lists, recipe.seq_len, rng), 0, epoch + 1
        batch = rows[cursor : cursor + recipe.batch_size]
        cursor += recipe.batch_size

        lr = lr_at(step, total_steps, recipe)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu" if batch.device.type == "cpu" else "cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        step += 1
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        tokens_per_s = step * batch.numel() / (time.time() - start)
        bar.update(1)
        bar.set_postfix(loss=f"{smooth:.3f}", tok_s=f"{tokens_per_s:.0f}", epoch=epoch)
        if step % 100 == 0:
            log(f"step {step} loss {smooth:.4f} lr {lr:.2e} tok/s {tokens_per_s:.0f} "
                f"epoch {epoch} elapsed {time.time() - start:.0f}s")
    bar.close()
    return {"steps": step, "epochs": epoch + cursor / max(len(rows), 1), "tokens": step * recipe.batch_size *
            recipe.seq_len, "train_seconds": round(time.time() - start, 1), "final_train_loss": smooth}


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_loss(model, tokenizer, texts: list[str], seq_len: int) -> tuple[float, int]:
    """Mean next-token loss in nats/token over texts (each as a plain document,
    cut into seq_len chunks that never cross files). Returns (loss, tokens scored)."""
    model.eval()
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text + END, add_special_tokens=False)["input_ids"]
        for begin in range(0, len(ids) - 1, seq_len):
            chunk = torch.tensor([ids[begin : begin + seq_len]])
            if chunk.shape[1] < 2:
                continue
            logits = model(input_ids=chunk).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return total / max(count, 1), count


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
    """Unique n-grams / all n-grams: ~1 for varied text, -> 0 when a loop repeats."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def longest_repeated_suffix(tokens: list[int]) -> int:
    """Length of the longest suffix that also occurs earlier in the sequence. A greedy
    loop of period p over L tokens gives ~L - p; ordinary code gives a few tokens."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length :]
        if any(tokens[s : s + length] == suffix for s in range(n - length)):
            return length
    return 0


LOOP_KINDS = ("plain", "mid", "chat")
MID_OFFSET = 512  # "mid" prompts start this many tokens into a held-out file


def loop_report(model, tokenizer, heldout: dict[str, str], recipe: ToyRecipe) -> dict:
    """Greedy continuations of held-out prompts vs the true continuations.

    Three prompt kinds: the first 64 tokens of a held-out file (plain), 64 tokens from
    MID_OFFSET on (mid), and a chat request for one of its definitions. The same measures
    on the real text are the reference: code repeats itself a little, so the target is
    'close to real', not 1.0.
    """
    model.eval()
    plain, mids, chats = [], [], []
    for rel, text in heldout.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= 64 + recipe.eval_new_tokens:
            plain.append((ids[:64], ids[64 : 64 + recipe.eval_new_tokens]))
        if len(ids) >= MID_OFFSET + 64 + recipe.eval_new_tokens:
            mid = ids[MID_OFFSET:]
            mids.append((mid[:64], mid[64 : 64 + recipe.eval_new_tokens]))
        for prompt, source in definition_prompts(rel, text)[:2]:
            messages = [{"role": "user", "content": prompt}]
            prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
            answer_ids = tokenizer(source + END, add_special_tokens=False)["input_ids"][: recipe.eval_new_tokens]
            chats.append((prompt_ids["input_ids"], answer_ids))
    prompts = {"plain": plain, "mid": mids, "chat": chats}

    report, samples = {}, []
    for kind in LOOP_KINDS:
        pairs = prompts[kind][: recipe.eval_prompts]
        generated, real = [], []
        for prompt_ids, true_ids in tqdm(pairs, desc=f"greedy {kind}", leave=False):
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=recipe.eval_new_tokens,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            new = out[0, len(prompt_ids):].tolist()
            generated.append(new)
            real.append(true_ids)
            if sum(s["kind"] == kind for s in samples) < 2:  # keep two of each kind for BUILD.md
                samples.append({"kind": kind, "prompt": tokenizer.decode(prompt_ids), "greedy": tokenizer.decode(new)})

        def mean(values):
            return round(sum(values) / max(len(values), 1), 4)

        long_gens = [g for g in generated if len(g) >= 32]  # loop measures need some length
        report[kind] = {
            "prompts": len(pairs),
            "distinct_4gram_greedy": mean([distinct_ngram_ratio(g) for g in long_gens]),
            "distinct_4gram_real": mean([distinct_ngram_ratio(r) for r in real]),
            "repeated_suffix_greedy": mean([longest_repeated_suffix(g) for g in long_gens]),
            "repeated_suffix_real": mean([longest_repeated_suffix(r) for r in real]),
            "looping_fraction": mean([longest_repeated_suffix(g) >= 32 for g in long_gens]),
            "ended_with_eos": mean([bool(g) and g[-1] == tokenizer.eos_token_id for g in generated]),
            # Loops can also be "fixed" by emitting junk; U+FFFD marks tokens that do not decode to text.
            "garbled_greedy": mean(["\ufffd" in tokenizer.decode(g) for g in generated]),
            "garbled_real": mean(["\ufffd" in tokenizer.decode(r) for r in real]),
        }
        if kind == "chat":  # do finished answers parse as Python?
            finished = [tokenizer.decode(g[:-1]) for g in generated if g and g[-1] == tokenizer.eos_token_id]
            report[kind]["finished_answers_parse"] = mean([_parses(t) for t in finished]) if finished else None
    report["samples"] = samples
    return report


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
        return True
    except (SyntaxError, ValueError):
        return False


# --------------------------------------------------------------------------- build


def build_toy_target(
    out_dir,
    *,
    steps: int | None = None,
    minutes: float | None = None,
    seed: int = 0,
    recipe: ToyRecipe | None = None,
    stdlib_dir=None,
    overwrite: bool = False,
    command: str | None = None,
    init_from=None,
) -> pathlib.Path:
    """Train the toy target and save it to out_dir (written to a temp folder, then renamed).

    `init_from` skips pretraining by loading an earlier build of the same pretraining
    (same seed, --steps and recipe); only the unlikelihood phase then runs."""
    recipe = recipe or ToyRecipe()
    if (steps is None) == (minutes is None):
        raise SpecdraftError("give exactly one of --steps N or --minutes M")
    if recipe.num_layers < 7:
        raise SpecdraftError(f"num_layers={recipe.num_layers}: use >= 7 so EAGLE-3 taps (2, N//2, N-3) are distinct")
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise SpecdraftError(f"{out_dir} already exists; pass --overwrite or choose another --out")
    if out_dir.exists():  # --overwrite replaces an earlier build, never a folder of the user's
        check_replaceable_output(out_dir, TOY_TARGET_OWNER, "--out")

    torch.manual_seed(seed)
    torch.set_num_threads(recipe.threads)
    started = time.time()
    lines = []

    def log(message):
        lines.append(message)
        tqdm.write(message)
        sys.stdout.flush()  # so a forked child never re-flushes our buffer into a redirected log

    files = list_source_files(stdlib_dir)
    if recipe.max_files:  # a deterministic subset, spread over the hash space
        keep = sorted(files, key=lambda rel: hashlib.sha256(rel.encode()).hexdigest())[: recipe.max_files]
        files = {rel: files[rel] for rel in sorted(keep)}
    train_files, heldout_files = split_files(files, recipe.heldout_percent)
    log(f"python {sys.version.split()[0]} stdlib: {len(train_files)} train files, {len(heldout_files)} held-out files")

    texts = training_texts(train_files, recipe.chat_fraction, random.Random(seed))
    if init_from:
        base = check_init_from(init_from, steps=steps, seed=seed, recipe=recipe, train_files=len(train_files))
        tokenizer = AutoTokenizer.from_pretrained(init_from)
    else:
        tokenizer = train_tokenizer(texts, recipe.vocab_size, recipe.max_position_embeddings)
    token_lists = [enc for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    num_tokens = sum(map(len, token_lists))
    log(f"{len(texts)} training samples, {num_tokens} tokens, vocab {len(tokenizer)}, "
        f"{sum(map(len, texts)) / num_tokens:.2f} chars/token")

    if init_from:
        if num_tokens != base["train_tokens_per_epoch"]:
            raise SpecdraftError(f"--init-from {init_from} was trained on {base['train_tokens_per_epoch']} tokens per "
                                 f"epoch, this stdlib gives {num_tokens}: it is not the same pretraining")
        model = AutoModelForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        stats = {k: base[k] for k in ("steps", "epochs", "tokens", "train_seconds", "final_train_loss")}
        log(f"pretraining: loaded {init_from} (built by `{base['command']}`) instead of retraining it")
    else:
        model = make_model(recipe, tokenizer)
        log(f"LlamaForCausalLM {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, recipe {dataclasses.asdict(recipe)}")
        stats = train(model, token_lists, recipe, steps=steps, minutes=minutes, seed=seed, log=log)
        log(f"trained {stats['steps']} steps, {stats['tokens']} tokens, {stats['epochs']:.2f} epochs in {stats['train_seconds']}s")

    pretrained = None
    if recipe.unlikelihood_steps:
        # Round to bf16 as a saved checkpoint is, so --init-from a saved build starts from the same weights.
        model = model.to(torch.bfloat16).to(torch.float32)
        loss, _ = heldout_loss(model, tokenizer, list(heldout_files.values()), recipe.seq_len)
        loops = loop_report(model, tokenizer, heldout_files, recipe)
        pretrained = {"heldout_loss": loss, **{kind: loops[kind] for kind in LOOP_KINDS}}
        log(f"after pretraining: held-out loss {loss:.4f}; " + "; ".join(
            f"greedy {kind} looping {loops[kind]['looping_fraction']}, distinct-4gram {loops[kind]['distinct_4gram_greedy']}"
            for kind in LOOP_KINDS))
        rows = packed_rows(token_lists, recipe.seq_len, random.Random(seed + 1))
        file_starts = plain_file_starts(token_lists, tokenizer.convert_tokens_to_ids("<|user|>"),
                                        recipe.ul_prefix_len + recipe.ul_new_tokens)
        log(f"unlikelihood prompts: {len(file_starts)} plain file starts, chat prompts and any position, in turn")
        stats.update(unlikelihood_finetune(
            model, rows, file_starts, steps=recipe.unlikelihood_steps, lr=recipe.ul_lr, weight_decay=recipe.weight_decay,
            batch_size=recipe.ul_batch_size, prefix_len=recipe.ul_prefix_len, new_tokens=recipe.ul_new_tokens,
            ngram=recipe.ul_ngram, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
            assistant_id=tokenizer.convert_tokens_to_ids("<|assistant|>"), seed=seed + 1, log=log))

    # Save in bf16 into a temp folder, measure it there; only a complete folder replaces out_dir.
    with atomic_folder(out_dir, owner=TOY_TARGET_OWNER) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         do_sample=False, max_new_tokens=256).save_pretrained(tmp)

        # Measure the model as saved (bf16 weights, run in fp32), as a user would load it.
        saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        loss, scored = heldout_loss(saved, tokenizer, list(heldout_files.values()), recipe.seq_len)
        log(f"held-out loss {loss:.4f} nats/token over {scored} tokens ({len(heldout_files)} files)")
        loops = loop_report(saved, tokenizer, heldout_files, recipe)
        for kind in LOOP_KINDS:
            log(f"greedy {kind}: " + ", ".join(f"{k} {v}" for k, v in loops[kind].items()))

        # A few held-out files with their own losses, shipped so a test can recompute them
        # on any interpreter (the stdlib differs between Python versions).
        check = sorted(heldout_files, key=lambda rel: len(heldout_files[rel]))[len(heldout_files) // 2 :][:3]
        check_files = []
        for rel in check:
            text = heldout_files[rel][:6000]
            file_loss, file_tokens = heldout_loss(saved, tokenizer, [text], recipe.seq_len)
            check_files.append({"path": rel, "text": text, "loss": file_loss, "tokens": file_tokens})
        record = {
            "command": command,
            "init_from": None if not init_from else {"path": str(init_from), "command": base["command"]},
            "seed": seed,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "recipe": dataclasses.asdict(recipe),
            "train_files": len(train_files),
            "heldout_files": sorted(heldout_files),
            "train_tokens_per_epoch": num_tokens,
            **stats,
            "pretrained": pretrained,
            "heldout_loss": loss,
            "heldout_tokens": scored,
            "loops": loops,
            "check_files": check_files,
            "build_seconds": round(time.time() - started, 1),
        }
        (tmp / "build_record.json").write_text(json.dumps(record, indent=1))
        (tmp / "build_log.txt").write_text("\n".join(lines) + "\n")
        if init_from:  # keep the skipped pretraining's own log beside this one
            shutil.copyfile(pathlib.Path(init_from) / "build_log.txt", tmp / "pretraining_log.txt")
        write_build_md(tmp)

    log(f"saved {out_dir} in {record['build_seconds']}s")
    return out_dir


def check_init_from(folder, *, steps, seed, recipe: ToyRecipe, train_files: int) -> dict:
    """The build record of `folder`, if it is this same pretraining; a clear error if not."""
    path = pathlib.Path(folder) / "build_record.json"
    if not path.is_file():
        raise SpecdraftError(f"--init-from {folder}: no build_record.json there; pass a folder `specdraft toy-target` built")
    base = json.loads(path.read_text())
    if base.get("unlikelihood_steps"):
        raise SpecdraftError(f"--init-from {folder} was already fine-tuned ({base['unlikelihood_steps']} unlikelihood "
                             "steps); pass a pretraining-only build, so one command can reproduce the result")
    mine = {k: v for k, v in dataclasses.asdict(recipe).items() if k not in NOT_PRETRAINING}
    theirs = {k: v for k, v in base["recipe"].items() if k not in NOT_PRETRAINING}
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differ or base["seed"] != seed or base["steps"] != steps or base["train_files"] != train_files:
        raise SpecdraftError(
            f"--init-from {folder} is a different pretraining (it ran --steps {base['steps']} --seed {base['seed']} "
            f"on {base['train_files']} files; recipe fields that differ: {differ or 'none'}); "
            "pass the same --steps, --seed and recipe flags as its build, or drop --init-from"
        )
    return base


def write_build_md(folder) -> None:
    """BUILD.md: how the folder was made and what it measures, from build_record.json + build_log.txt."""
    folder = pathlib.Path(folder)
    record = json.loads((folder / "build_record.json").read_text())
    r, loops = record["recipe"], record["loops"]
    rows = "\n".join(
        f"| {kind} | {loops[kind]['prompts']} | {loops[kind]['distinct_4gram_greedy']} | {loops[kind]['distinct_4gram_real']} "
        f"| {loops[kind]['repeated_suffix_greedy']} | {loops[kind]['repeated_suffix_real']} | {loops[kind]['looping_fraction']} "
        f"| {loops[kind]['garbled_greedy']} | {loops[kind]['garbled_real']} | {loops[kind]['ended_with_eos']} |"
        for kind in LOOP_KINDS
    )
    phases = ""
    if record.get("pretrained"):  # the unlikelihood phase ran: show the model before and after it
        before = record["pretrained"]
        table = "\n".join(
            f"| {kind} looping (repeated suffix >= 32) | {before[kind]['looping_fraction']} | {loops[kind]['looping_fraction']} |\n"
            f"| {kind} distinct 4-gram (real {loops[kind]['distinct_4gram_real']}) | {before[kind]['distinct_4gram_greedy']} "
            f"| {loops[kind]['distinct_4gram_greedy']} |\n"
            f"| {kind} garbled (real {loops[kind]['garbled_real']}) | {before[kind]['garbled_greedy']} | {loops[kind]['garbled_greedy']} |"
            for kind in LOOP_KINDS
        )
        phases = f"""
## Before and after unlikelihood fine-tuning

{record['unlikelihood_steps']} steps in {record['unlikelihood_seconds']} s, alternating sequence-level unlikelihood
updates on the model's own greedy continuations of training prefixes (Welleck et al. 2020; repeated
{r['ul_ngram']}-grams penalized, plus the MLE loss of the prefixes' true continuations) with MLE updates, lr {r['ul_lr']} annealed over the last quarter. Share of its own greedy tokens inside a
repeated {r['ul_ngram']}-gram: {record['repeat_share_first']:.3f} over the first 25 UL updates,
{record['repeat_share_last']:.3f} over the last 25.

| | after pretraining | after unlikelihood fine-tuning |
|---|---|---|
| held-out loss (nats/token) | {before['heldout_loss']:.4f} | {record['heldout_loss']:.4f} |
{table}
"""
    origin = ""
    if record.get("init_from"):
        origin = (f"\nPretraining was not rerun: `--init-from {record['init_from']['path']}` loaded the build made by "
                  f"`{record['init_from']['command']}`, which is the same pretraining (checked: seed, steps, recipe, "
                  "tokens per epoch); its log is `pretraining_log.txt`. Without `--init-from` the command retrains it first.\n")
    samples = "\n\n".join(
        f"**{s['kind']}** prompt:\n````\n{s['prompt']}\n````\ngreedy continuation:\n````\n{s['greedy']}\n````"
        for s in loops["samples"]
    )
    text = f"""# Toy target build

Built by this exact command (Python {record['python']}, torch {record['torch']}, {r['threads']} thread(s), seed {record['seed']}):

```
{record['command']}
```

`--minutes` runs are replayable step for step with `--steps {record['steps']}` (same seed and stdlib).
{origin}
| | |
|---|---|
| model | LlamaForCausalLM, {r['num_layers']} layers, hidden {r['hidden_size']}, {r['num_heads']} heads / {r['num_kv_heads']} KV heads, MLP {r['intermediate_size']}, tied embeddings, bf16 weights |
| tokenizer | byte-level BPE, vocab {r['vocab_size']}, chat template with `{{% generation %}}` markers |
| data | {record['train_files']} train / {len(record['heldout_files'])} held-out stdlib files (file-level split, {r['heldout_percent']}% by path hash); {record['train_tokens_per_epoch']} tokens per epoch |
| training | {record['steps']} steps x {r['batch_size']} x {r['seq_len']} tokens = {record['tokens']} tokens ({record['epochs']:.2f} epochs) in {record['train_seconds']} s; whole build {record['build_seconds']} s |
| final train loss | {record['final_train_loss']:.4f} nats/token (smoothed) |
| **held-out loss** | **{record['heldout_loss']:.4f} nats/token** over {record['heldout_tokens']} tokens |

## Greedy continuations of held-out prompts ({r['eval_new_tokens']} new tokens)

"real" is the same measure on the true continuation. Distinct 4-gram ratio: unique/all 4-grams
(1 = no repeats). Repeated suffix: longest suffix that already occurred (a loop of period p over
L tokens gives about L - p). Looping: repeated suffix >= 32 tokens. Garbled: the decoded text has
bytes that are not UTF-8 (U+FFFD), a model escaping loops through junk tokens.

| prompts | n | distinct 4-gram greedy | real | repeated suffix greedy | real | looping | garbled greedy | real | ended with the end token |
|---|---|---|---|---|---|---|---|---|---|
{rows}

Chat answers that ended with `<|end|>` and parse as Python: {loops['chat'].get('finished_answers_parse')}
{phases}
{samples}

## Log

```
{(folder / 'build_log.txt').read_text().strip()}
```
"""
    (folder / "BUILD.md").write_text(text)


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="toy-target", help="output folder (default: ./toy-target)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="train this many steps (deterministic given --seed)")
    length.add_argument("--minutes", type=float,
                        help="train for this long (default 10 if neither is given); the lr decays over the last "
                             "--decay-fraction of it and the step count reached is logged for --steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stdlib-dir", help="Python Lib/ folder to train on (default: this interpreter's)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--init-from", help="skip pretraining: start from this earlier build of the same "
                                            "--steps/--seed/recipe (only the unlikelihood phase runs)")
    for field in dataclasses.fields(ToyRecipe):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=field.type, default=field.default,
                            help=f"(default: {field.default})")


def run(args: argparse.Namespace) -> int:
    recipe = ToyRecipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ToyRecipe)})
    steps, minutes = args.steps, args.minutes
    if steps is None and minutes is None:
        minutes = 10.0
    argv = sys.argv[sys.argv.index("toy-target") + 1 :] if "toy-target" in sys.argv else sys.argv[1:]
    command = " ".join(["specdraft toy-target", *argv])  # recorded so the build can be replayed
    build_toy_target(args.out, steps=steps, minutes=minutes, seed=args.seed, recipe=recipe,
                     stdlib_dir=args.stdlib_dir, overwrite=args.overwrite, command=command,
                     init_from=args.init_from)
    return 0


if __name__ == "__main__":  # `python -m specdraft.toy_build.builder ...` (the CLI: `specdraft toy-target`)
    cli = argparse.ArgumentParser(prog="specdraft toy-target", description=__doc__.splitlines()[0])
    add_arguments(cli)
    sys.exit(run(cli.parse_args()))
