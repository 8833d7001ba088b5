"""pdlab: a hands-on lab for disaggregated prefill/decode serving of LLMs."""

__version__ = "0.1.0"
