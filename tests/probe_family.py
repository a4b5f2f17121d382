"""A deliberately tiny drafter family for testing the training spine on its own.

It predicts the next token from the target's last hidden state with one linear
layer. While training it adds a little noise, like dropout, drawn from all three
global RNGs a checkpoint restores (torch, Python, NumPy), so a resume that skips
any of them ends with other weights. Each process gets its own streams, so a
resume that hands every process rank 0's RNG is caught too.
Import it (``import probe_family``) to register it as family "probe".
"""

import json
import os
import random
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specdraft.contract import Family, LossOutput, TargetNeeds, target_example
from specdraft.drafters import FAMILIES
from specdraft.optim import recipe_optimization

NEEDS = TargetNeeds(final_hidden=True)  # it reads the final hidden state, and no logits


@dataclass
class ProbeConfig:
    noise: float = 0.01
    draft_vocab_size: int | None = None


class Probe(nn.Module):
    family = "probe"
    needs = NEEDS

    def __init__(self, hidden: int, vocab: int, cfg: ProbeConfig):
        super().__init__()
        self.cfg = cfg
        self.head = nn.Linear(hidden, vocab)

    calls = 0

    def _fault_injection(self):
        """Test hooks: PROBE_{KILL,SIGTERM,SIGINT,NAN}_AT_CALL=n acts on the n-th training micro-batch."""
        if not self.training:
            return False
        Probe.calls += 1
        if Probe.calls == int(os.environ.get("PROBE_KILL_AT_CALL", 0)):
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no handler, no cleanup
        for name in ("SIGTERM", "SIGINT"):
            if Probe.calls == int(os.environ.get(f"PROBE_{name}_AT_CALL", 0)):
                os.kill(os.getpid(), getattr(signal, name))
        return Probe.calls == int(os.environ.get("PROBE_NAN_AT_CALL", 0))

    def trained_module(self):
        return self

    def configure_optimizers(self, recipe, total_steps):
        return recipe_optimization(self, recipe, total_steps)

    def prepare(self, batch, context):
        return target_example(batch, context, self.needs)

    def compute_loss(self, batch, target_out):
        make_nan = self._fault_injection()
        feature = target_out.final_hidden.float()
        if self.training:
            scale = self.cfg.noise * (0.5 + random.random()) * (0.5 + np.random.random())
            feature = feature + scale * torch.randn_like(feature)
        logits = self.head(feature)[:, :-1]
        labels = batch["input_ids"][:, 1:]
        mask = batch["loss_mask"][:, 1:].bool()
        loss = F.cross_entropy(logits[mask], labels[mask])
        if make_nan:
            loss = loss * float("nan")
        acc = (logits[mask].argmax(-1) == labels[mask]).float().mean()
        return LossOutput(loss, {"acc_0": acc.detach()})

    def save_pretrained(self, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"family": "probe", "hidden": self.head.in_features,
                                                      "vocab": self.head.out_features, **asdict(self.cfg)}))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, path / "model.safetensors")


def build(target, cfg, draft_vocab=None):
    # Its own seed: the initial weights do not depend on how much RNG loading the target consumed.
    torch.manual_seed(1234)
    probe = Probe(target.hidden_size, target.vocab_size, cfg)
    target.require(probe.needs)
    seed = 1234 + (dist.get_rank() if dist.is_initialized() else 0)  # one noise stream per process
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return probe


def load(path, target=None):
    meta = json.loads((Path(path) / "config.json").read_text())
    model = Probe(meta["hidden"], meta["vocab"], ProbeConfig(meta["noise"], meta["draft_vocab_size"]))
    model.load_state_dict(load_file(Path(path) / "model.safetensors"))
    return model


FAMILIES["probe"] = Family("probe", ProbeConfig, lambda cfg, target_config: NEEDS, build, load)
