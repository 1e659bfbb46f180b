"""KV caches: contiguous (chapters 1-6), paged and rows (chapter 7), static (chapter 8: device-side lengths, for CUDA
graphs), behind one interface (``protocol``)."""

from .contiguous import KVCache, KVCacheOverflow
from .paged import KVPoolExhausted, PagedKVCache
from .protocol import KVCacheProtocol, RaggedKVCache
from .rows import RowKVCache
from .static import StaticKVCache

__all__ = ["KVCache", "KVCacheOverflow", "KVCacheProtocol", "KVPoolExhausted", "PagedKVCache", "RaggedKVCache", "RowKVCache",
           "StaticKVCache"]
