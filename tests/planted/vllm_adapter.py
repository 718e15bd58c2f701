"""Planted bugs in the vLLM adapter (``kvoffload.integrations.vllm``). Importing this module
imports vLLM: the catalogue names the classes by module and class name
(:class:`tests.planted.PlantedAdapter`), and the test loads them from there.
"""

from __future__ import annotations

from collections.abc import Collection

from vllm.v1.kv_offload.base import OffloadKey, PrepareStoreOutput, ReqContext

from kvoffload.integrations.vllm import KvoffloadManager


class NamesTheLastOfferedKeysAsStored(KvoffloadManager):
    """prepare_store names the last ``len(plan)`` offered keys as the keys to store (the
    ones stored already taken for a prefix of the offer): when they are not a prefix, vLLM
    copies one key's block into the CPU block of another."""

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, req_context)
        if out is None:
            return None
        offered = list(keys)
        new = offered[len(offered) - len(out.keys_to_store) :]
        return PrepareStoreOutput(
            keys_to_store=new, store_spec=out.store_spec, evicted_keys=out.evicted_keys
        )
