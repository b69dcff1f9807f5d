"""The adapters loaded on each rank: requests name adapters, and each rank keeps the ones it loaded, least
recently used first, within --lora-cache-bytes.

Loading is diffusers' own: the family's `load_lora_into_transformer` injects PEFT's LoRA layers around the
transformer's linears, as `pipe.load_lora_weights` does (`Adapter.load_into`, checks.py). For each request
`set_adapters` picks the request's adapters and scales; after it `disable_lora` leaves every layer computing its
base output alone, the base model's output exactly. The base weights never change here.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from dit_svc.lora.checks import Adapter, file_stamp, read_adapter
from dit_svc.lora.directory import adapter_path
from dit_svc.lora.settings import AdapterError, LoraSettings, loader_class, peft_name
from stagekit.errors import NotFoundError

logger = logging.getLogger(__name__)


@dataclass
class _Loaded:
    bytes: int
    stamp: tuple[int, int]


class AdapterCache:
    """The adapters loaded into this rank's transformer, least recently used first, at most `cache_bytes` of them.

    Every rank of a DiT group holds one and sees the same requests in the same order, so each loads and evicts
    as the others do. Outside `applied` every LoRA layer is disabled: the transformer computes the base model.
    """

    def __init__(self, transformer: nn.Module, settings: LoraSettings, num_threads: int = 4) -> None:
        self.transformer = transformer
        self.settings = settings
        self.pipeline_class = loader_class(settings.pipeline)
        self.num_threads = num_threads
        self.loaded: OrderedDict[str, _Loaded] = OrderedDict()
        # Read and checked by `check`, not loaded yet (the request's next `prepare` loads them).
        self.checked: dict[str, Adapter] = {}
        self.hits = 0
        self.misses = 0

    @property
    def loaded_bytes(self) -> int:
        return sum(entry.bytes for entry in self.loaded.values())

    def check(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Reads and checks each of the request's adapters that is not loaded (or whose file changed since),
        without touching the model; raises NotFoundError or AdapterError naming the adapter. Rank 0 of a group
        runs it before the group does, so that a bad adapter fails only its request."""
        wanted = [name for name, _ in loras]
        self.checked = {name: adapter for name, adapter in self.checked.items() if name in wanted}
        if not wanted:
            return
        directory = self.settings.directory
        if directory is None:
            raise NotFoundError(f"lora '{wanted[0]}': the DiT serves no adapters per request (no --lora-dir)")
        for name in wanted:
            path = adapter_path(directory, name)
            stamp = file_stamp(path)
            entry = self.loaded.get(name)
            if (entry is not None and entry.stamp == stamp) or (
                name in self.checked and self.checked[name].stamp == stamp
            ):
                continue
            self.checked[name] = read_adapter(
                name, path, self.pipeline_class, self.transformer, self.settings.max_file_bytes, self.num_threads
            )
        needed = sum(self.checked[name].bytes if name in self.checked else self.loaded[name].bytes for name in wanted)
        if needed > self.settings.cache_bytes:
            raise AdapterError(
                f"loras: {', '.join(wanted)} take {needed} bytes on the DiT, more than its --lora-cache-bytes "
                f"{self.settings.cache_bytes}"
            )

    def prepare(self, loras: tuple[tuple[str, float], ...]) -> None:
        """Loads the request's adapters that are not loaded, evicting the least recently used others beyond
        --lora-cache-bytes."""
        self.check(loras)
        wanted = [name for name, _ in loras]
        fresh = [self.checked.pop(name) for name in wanted if name in self.checked]
        for adapter in fresh:
            if adapter.name in self.loaded:  # its file was replaced
                self._unload(adapter.name)
        self.hits += len(wanted) - len(fresh)
        self.misses += len(fresh)
        incoming = sum(adapter.bytes for adapter in fresh)
        for name in list(self.loaded):
            if self.loaded_bytes + incoming <= self.settings.cache_bytes:
                break
            if name not in wanted:
                self._unload(name)
        for adapter in fresh:
            self._load(adapter)
        for name in wanted:
            self.loaded.move_to_end(name)

    def _load(self, adapter: Adapter) -> None:
        started = time.perf_counter()
        with warnings.catch_warnings():
            # PEFT warns at every adapter after the first that the model holds several: that is the point here.
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            adapter.load_into(self.pipeline_class, self.transformer, peft_name(adapter.name))
        self.transformer.disable_lora()
        self.loaded[adapter.name] = _Loaded(adapter.bytes, adapter.stamp)
        logger.info(
            "lora '%s': loaded into the transformer in %.3f s (%d adapters, %d bytes cached)",
            adapter.name,
            time.perf_counter() - started,
            len(self.loaded),
            self.loaded_bytes,
        )

    def _unload(self, name: str) -> None:
        with warnings.catch_warnings():
            # Deleting the adapter PEFT last activated makes it name another active: every layer is disabled anyway.
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.transformer.delete_adapters([peft_name(name)])
        del self.loaded[name]
        logger.info("lora '%s': evicted from the cache", name)

    @contextlib.contextmanager
    def applied(self, loras: tuple[tuple[str, float], ...]) -> Iterator[None]:
        """The request's adapters at their scales for the duration; the base model before and after."""
        if not loras:
            yield
            return
        self.prepare(loras)
        self.transformer.enable_lora()
        self.transformer.set_adapters([peft_name(name) for name, _ in loras], [scale for _, scale in loras])
        try:
            yield
        finally:
            self.transformer.disable_lora()
