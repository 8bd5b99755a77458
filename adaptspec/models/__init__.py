"""Model specs, pulling, and the compact Llama-family forward over a slot KV cache."""
from adaptspec.models.registry import BUILTIN, DEFAULT_DRAFT, DEFAULT_TARGET, HubUnreachableError, home, resolve

__all__ = ["BUILTIN", "DEFAULT_DRAFT", "DEFAULT_TARGET", "HubUnreachableError", "home", "resolve"]
