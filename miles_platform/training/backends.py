"""--train-backend -> backend class (the registry; each backend imports only `backend.ModelBackend`)."""

from __future__ import annotations

from miles_platform.errors import ConfigError
from miles_platform.training.backend import ModelBackend


def get_backend_class(name: str) -> type[ModelBackend]:
    if name == "fsdp":
        from miles_platform.training.fsdp_backend import FSDPBackend

        return FSDPBackend
    if name == "megatron":
        from miles_platform.training.megatron_backend import MegatronBackend

        return MegatronBackend
    raise ConfigError(f"--train-backend {name!r}: allowed values are fsdp, megatron")
