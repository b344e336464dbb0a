"""disagg: prefill/decode disaggregation KV transfer for hybrid LLMs."""

__version__ = "0.1.0"
