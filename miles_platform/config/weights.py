"""How a new policy version reaches the engines (docs/weights.md): the transport, its interval,
the disk-delta format, and what in-flight requests do during the update."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import POSITIVE, flag, flag_name
from miles_platform.errors import ConfigError

RANGES: dict[str, tuple] = {"update_weights_interval": POSITIVE}

# Miles' own names for flags this project spelled differently first: both are accepted (CLI and YAML)
ALIASES = {
    "update_weight_delta_encoding": "disk_delta_encoding",
    "update_weight_delta_checksum": "disk_delta_checksum",
}


@dataclass
class WeightUpdateFlags:
    update_weight_transfer_mode: str = flag(
        "tensor",
        "weight-update",
        "transport",
        choices=("tensor", "disk-delta", "mooncake", "broadcast", "disk", "p2p"),
    )
    update_weights_interval: int = flag(1, "weight-update", "rollouts between weight updates")
    update_weight_disk_dir: str | None = flag(None, "weight-update", "publication dir for disk-delta")
    update_weight_local_checkpoint_dir: str | None = flag(
        None, "weight-update", "engine-local checkpoint dir for disk-delta"
    )
    disk_delta_encoding: str = flag("xor", "weight-update", "delta encoding", choices=("xor", "overwrite"))
    disk_delta_checksum: str = flag(
        "xxh3-128", "weight-update", "checksum", choices=("xxh3-128", "blake3", "adler32")
    )
    disk_delta_keyframe_interval: int = flag(10, "weight-update", "full snapshot every N versions")
    disk_delta_encode_workers: int = flag(
        1, "weight-update", "threads encoding tensors in parallel (XOR, planes, zstd, checksums)"
    )
    custom_update_weight_post_write_path: str | None = flag(
        None,
        "weight-update",
        "disk-delta: <module>.<fn>(args, version_dir, engines) called once a version is written, before "
        "engines pull it (e.g. commit an object-store-backed mount)",
    )
    pause_generation_mode: str = flag(
        "retract",
        "weight-update",
        "in-flight requests during the update",
        choices=("abort", "retract", "in_place"),
    )
    check_weight_update_equal: bool = flag(
        False, "weight-update", "verify engine weights equal trainer weights after sync"
    )

    @property
    def uses_disk_delta(self) -> bool:
        """Versions are published as disk-delta files under --update-weight-disk-dir, which engines pull."""
        return self.update_weight_transfer_mode == "disk-delta"

    def _check_weight_update_flags(self) -> None:
        if self.update_weight_transfer_mode == "p2p":
            raise ConfigError(
                "--update-weight-transfer-mode p2p: Miles' point-to-point transfer (each trainer rank writes "
                "its shards straight into the engines' memory over RDMA with a transfer engine) is not built "
                "here; use broadcast (NCCL from the trainer to the engines, Miles' default), disk-delta "
                "(changed bytes through a shared dir) or mooncake"
            )
        if self.uses_disk_delta and not self.update_weight_disk_dir:
            raise ConfigError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir")
        for name in ("disk_delta_keyframe_interval", "disk_delta_encode_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} must be >= 1, got {getattr(self, name)}")
