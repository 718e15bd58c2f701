"""Plug-ins that put kvoffload inside inference engines, with no change to the engines.

- ``kvoffload.integrations.vllm``: ``KvoffloadSpec`` and ``KvoffloadManagerSpec``, offloading
  specs for vLLM's ``OffloadingConnector`` (vLLM 0.33).
- ``kvoffload.integrations.vllm_tier``: ``KvoffloadValkeyTier``, kvoffload's remote tier (a
  Valkey/Redis server) as a secondary tier of vLLM 0.33's ``TieringOffloadingSpec``.
- ``kvoffload.integrations.sglang``: ``KvoffloadHiCacheStorage``, an L3 storage backend for
  SGLang's HiCache.

Each module imports its engine; this package imports neither (docs/integrations.md).
"""
