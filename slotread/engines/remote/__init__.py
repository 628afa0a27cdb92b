"""Engines that read through a remote server speaking vLLM's completions API (``wire.py`` is the contract)."""
