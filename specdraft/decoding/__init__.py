"""Decoding: sampling (``sampling``), the verify step (``verify``) and the speculative decoder."""
