"""Triton kernels, installed as ``specdraft.kernels``.

Each kernel lives in its own module and needs triton; this package itself imports
nothing, so ``import specdraft.kernels`` works without triton.

  rejection_sampler.rejection_sample  the verify step (see specdraft.decoding.verify)
  tree_sampler.tree_sample            the tree verify step (see specdraft.decoding.tree_verify)
"""
