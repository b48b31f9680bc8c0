"""hybridkv: an inference engine for hybrid attention / linear-recurrence language models."""

from hybridkv.cache.config import CacheConfig
from hybridkv.cached_model import CachedModel
from hybridkv.errors import CacheFull, IntegrityError, NotSupported

__all__ = ["CacheConfig", "CacheFull", "CachedModel", "IntegrityError", "NotSupported"]
__version__ = "0.1.0"
