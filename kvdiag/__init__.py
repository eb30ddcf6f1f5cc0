"""kvdiag: reproduce, capture and diagnose kvcached/vLLM engine hangs."""

__version__ = "0.1.0"
