"""KV tiers below the pool: blocks of pages, named by content, stored on local disk and in Redis.

`create_kv_tiers` builds them from the cache configuration; `KVTiers` is what the scheduler
calls (promotion and demotion); `KVTier` is the interface each tier implements.
"""

from __future__ import annotations

from typing import Any

from plait.radix_cache import RadixCache
from plait.runtime.config import CacheConfig
from plait.runtime.kv_pool import KVPool
from plait.runtime.kv_tiers.block_format import BlockCodec, BlockError, BlockLayout
from plait.runtime.kv_tiers.fingerprint import kv_salt, weights_fingerprint
from plait.runtime.kv_tiers.hierarchy import KVTiers
from plait.runtime.kv_tiers.pool_io import PoolBlockIO
from plait.runtime.kv_tiers.tier import KVTier
from plait.runtime.tuning import TIER_BLOCK_TOKENS

__all__ = [
    "BlockCodec",
    "BlockError",
    "BlockLayout",
    "KVTier",
    "KVTiers",
    "create_kv_tiers",
    "engine_salt",
]


def engine_salt(core: Any) -> bytes:
    """The salt of an engine's page names (`fingerprint.kv_salt`), from what it loaded."""
    return kv_salt(
        weights_fingerprint(core.model_path),
        core.args,
        dtype=str(core.dtype).removeprefix("torch."),
        quantization=core.config.model.quantization,
        kv_dtype=str(core.kv_dtype).removeprefix("torch."),
        page_size=core.page_size,
        device_type=core.device.type,
    )


def create_kv_tiers(cc: CacheConfig, pool: KVPool, cache: RadixCache, salt: bytes) -> KVTiers:
    """The tiers `cc` names, fastest first (disk, then Redis)."""
    tiers: list[KVTier] = []
    if cc.kv_disk is not None:
        from plait.runtime.kv_tiers.disk import DiskTier

        tiers.append(DiskTier(cc.kv_disk, cc.kv_disk_bytes))
    if cc.kv_redis is not None:
        from plait.runtime.kv_tiers.redis_tier import RedisTier

        tiers.append(RedisTier(cc.kv_redis))
    block_pages = -(-TIER_BLOCK_TOKENS // cc.page_size)
    io = PoolBlockIO(pool, block_pages)
    return KVTiers(tiers, io, BlockCodec(salt, io.layout), cache)
