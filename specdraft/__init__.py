"""specdraft: train speculative-decoding drafters against a frozen target LLM."""

__version__ = "0.1.0"
