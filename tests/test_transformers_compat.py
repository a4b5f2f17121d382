"""specdraft.transformers_compat: the names transformers renamed, resolved for releases on both sides."""

from specdraft.transformers_compat import enable_activation_checkpointing


class Before524:  # transformers 5.17 (the GPU machines'): gradient_checkpointing_enable only
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.called = ("gradient", gradient_checkpointing_kwargs)


class From524(Before524):  # 5.24 on: activation_checkpointing_enable, and the old name warns
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.called = ("activation", activation_checkpointing_kwargs)


def test_activation_checkpointing_is_enabled_non_reentrant_by_the_method_each_release_has():
    old, new = Before524(), From524()
    enable_activation_checkpointing(old)
    enable_activation_checkpointing(new)
    assert old.called == ("gradient", {"use_reentrant": False})
    assert new.called == ("activation", {"use_reentrant": False})
