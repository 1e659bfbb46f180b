"""KV caches: contiguous (chapters 1-6), paged and rows (chapter 7), behind one interface (``protocol``)."""

from .contiguous import KVCache, KVCacheOverflow
from .paged import KVPoolExhausted, PagedKVCache
from .protocol import KVCacheProtocol, RaggedKVCache
from .rows import RowKVCache

__all__ = ["KVCache", "KVCacheOverflow", "KVCacheProtocol", "KVPoolExhausted", "PagedKVCache", "RaggedKVCache", "RowKVCache"]
