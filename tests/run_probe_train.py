"""`specdraft` CLI with the test-only "probe" family registered (for subprocess and accelerate tests).

PROBE_MUTANT=name first breaks the product on purpose, one of MUTANTS, so that
tests/test_mutants_training*.py can show a check catches that bug in a real
subprocess run. The product itself carries no test hooks.
"""

import os
import sys

import probe_family  # noqa: F401  (registers the family)
import torch

from specdraft import checkpoint, train
from specdraft.cli import main


def _after_load(edit):
    """Wrap the loop's load_checkpoint: ``edit(trainer_state, ckpt)`` runs after a correct load."""
    real = train.load_checkpoint

    def load_checkpoint(accelerator, ckpt, *args):
        state = real(accelerator, ckpt, *args)
        edit(state, ckpt)
        return state

    train.load_checkpoint = load_checkpoint


def resume_from_scratch():
    """--resume that silently starts over: nothing restored, step 0."""
    train.load_checkpoint = lambda *args: {"run": {}}


def lose_data_position():
    """--resume that restarts the checkpoint's epoch from its first batch."""
    _after_load(lambda state, ckpt: state["run"].update(batches_in_epoch=0))


def lose_epoch():
    """--resume that forgets which epoch it was in (its shuffle is epoch 0's)."""
    _after_load(lambda state, ckpt: state["run"].update(epoch=0))


def skip_rng_restore():
    """--resume that leaves every RNG as the fresh process seeded it."""
    checkpoint._set_rng_state = lambda state: None


def torch_rng_only():
    """--resume that restores torch's RNG but leaves Python's and NumPy's as the fresh process seeded them."""
    checkpoint._set_rng_state = lambda state: torch.set_rng_state(state["torch"])


def rank0_rng_everywhere():
    """--resume that gives every process rank 0's RNG streams."""
    _after_load(lambda state, ckpt: checkpoint._set_rng_state(torch.load(ckpt / "rng-rank0.pt", weights_only=True)))


def sigint_not_handled():
    """Only SIGTERM saves and stops; SIGINT keeps Python's KeyboardInterrupt."""
    import signal

    class SigtermOnly(train.StopRequested):
        def __enter__(self):
            self._old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
            return self

    # What a process started from a terminal has. A process started in the background by a
    # non-interactive shell inherits SIGINT ignored instead, and would then finish its run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    train.StopRequested = SigtermOnly


MUTANTS = {f.__name__: f for f in (resume_from_scratch, lose_data_position, lose_epoch, skip_rng_restore,
                                   torch_rng_only, rank0_rng_everywhere, sigint_not_handled)}

if __name__ == "__main__":
    if os.environ.get("PROBE_MUTANT"):
        MUTANTS[os.environ["PROBE_MUTANT"]]()
    sys.exit(main())
