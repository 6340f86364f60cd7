"""The scheduler side of a KV connector (offload to host memory, transfer between engines).

Protocol, per request:
1. At admission the scheduler asks `get_num_new_matched_tokens`: how many tokens beyond
   the local prefix hit the connector can supply, and whether the load is asynchronous.
2. After blocks are allocated, `update_state_after_alloc` names the blocks to load into.
3. `build_connector_meta` packs this step's loads and stores for the executor side.
4. The executor reports finished loads/stores and failed block ids in
   ModelRunnerOutput.kv_connector_output. An async load keeps the request in
   WAITING_FOR_REMOTE_KVS, holding its blocks, until its load is reported done.
5. At finish, `request_finished` sees the request's block table, pruned of out-of-window
   blocks on the processed basis; it may ask to delay the free until a store is done.
6. Each step's connector output is also handed to `update_connector_output`, so the
   scheduler side learns which of its loads and stores finished.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hybridserve.core.kv.spec import KVCacheConfig
from hybridserve.core.request import Request


class KVConnectorBase(ABC):
    def bind_kv_cache_config(self, kv_cache_config: KVCacheConfig) -> None:
        """The scheduler's KV layout, as its KVCacheManager runs it (with prefix caching,
        Mamba groups keep a state checkpoint per block); called once, before any request."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_local_computed_tokens: int) -> tuple[int, bool]:
        """(external tokens available beyond the local hit, whether the load is async)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """Blocks are allocated: remember where the external tokens should be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """Loads and stores for the executor side, attached to the SchedulerOutput."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        """(delay freeing until the executor reports the store done, extra params)."""

    def update_connector_output(self, kv_connector_output: Any) -> None:
        """The executor's report of finished loads/stores (KVConnectorOutput); default: ignore."""

    def record_stats(self, stats: Any) -> None:
        """Copy connector counters into the scheduler's SchedulerStats; default: none."""
