"""KV caches: contiguous (chapters 1-6) and paged (chapter 7), behind one interface."""

from .contiguous import KVCache, KVCacheOverflow
from .paged import KVPoolExhausted, PagedKVCache

__all__ = ["KVCache", "KVCacheOverflow", "KVPoolExhausted", "PagedKVCache"]
