"""KV caches: contiguous (chapters 1-6) and paged (chapter 7), behind one interface (``protocol``)."""

from .contiguous import KVCache, KVCacheOverflow
from .paged import KVPoolExhausted, PagedKVCache
from .protocol import KVCacheProtocol, RaggedKVCache

__all__ = ["KVCache", "KVCacheOverflow", "KVCacheProtocol", "KVPoolExhausted", "PagedKVCache", "RaggedKVCache"]
