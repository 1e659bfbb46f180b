"""KV caches: contiguous (chapters 1-6); the paged cache of chapter 7 joins behind the same interface."""

from .contiguous import KVCache, KVCacheOverflow

__all__ = ["KVCache", "KVCacheOverflow"]
