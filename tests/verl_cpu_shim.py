"""TEST CODE, not product code: run verl 0.9.1's FSDP2 training engine on CPU (gloo), for the multi-process tests.

verl 0.9.1 registers platforms only for nvidia / npu / amd (``verl.plugin.platform``) and its training engines
only for the devices cuda / npu. This shim registers a ``cpu`` platform (gloo, no device memory: every memory
query reports 0) and makes it current before verl's engine modules read it at import; the caller sets
``VERL_ENGINE_DEVICE=cuda`` so that ``EngineRegistry.new("language_model", "fsdp2")`` hands out verl's
``FSDPEngineWithLMHead`` (whose code runs on CPU tensors). Written against verl 0.9.1 (``VERL_VERSION``); a
different verl may need changes here, which :func:`install` reports.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any, Iterator

import torch

VERL_VERSION = "0.9.1"


def _device_module() -> types.ModuleType:
    """``torch.cpu`` plus the CUDA-style memory and RNG queries verl calls on its device module."""
    module = types.ModuleType("verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(module, name, getattr(torch.cpu, name))
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(module, name, lambda *a, **k: 0)
    module.mem_get_info = lambda *a, **k: (0, 0)
    module.reset_peak_memory_stats = lambda *a, **k: None
    module.empty_cache = lambda: None
    module.synchronize = lambda *a, **k: None
    module.current_device = lambda: "cpu"
    module.device_count = lambda: 1
    module.set_device = lambda *a, **k: None
    module.is_available = lambda: True
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = torch.get_rng_state
    module.set_rng_state = torch.set_rng_state
    module.memory_stats = lambda *a, **k: {}
    return module


def install() -> Any:
    """Register and select the CPU platform; returns it. Call before importing verl's engines."""
    import verl
    from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    if verl.__version__ != VERL_VERSION:
        raise RuntimeError(f"tests/verl_cpu_shim.py targets verl {VERL_VERSION}, found {verl.__version__}")
    device_module = _device_module()

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return device_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            # verl moves tensors with `.to(get_device_id())`: an index would mean cuda:N
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    os.environ["VERL_PLATFORM"] = "cpu"
    platform = PlatformCPU()
    set_platform(platform)
    return platform
