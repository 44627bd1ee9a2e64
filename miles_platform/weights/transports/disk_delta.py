"""`disk-delta`: publish weight_vNNNNNN (changed bytes only), engines patch local checkpoints, reload.

Publication and each engine's catch-up happen in `prepare` (overlapping generation); the
pause covers only the reload of the already-verified local checkpoint.
"""

from __future__ import annotations

import os

from miles_platform.models.checkpoint_layout import split_fused_experts
from miles_platform.weights.transports import TransferStats, Transport
from miles_platform.weights.transports.disk import update_from_disk


def engine_local_root(cfg) -> str:
    """The engines' local checkpoint dirs: --update-weight-local-checkpoint-dir, else beside the
    publication dir (an object-store one: beside this host's dir for it, store/remote.py)."""
    from miles_platform.store.remote import is_remote, mirror_path

    pub = cfg.update_weight_disk_dir
    return cfg.update_weight_local_checkpoint_dir or os.path.join(
        mirror_path(pub) if is_remote(pub) else pub, "..", "engine-local"
    )


class DiskDeltaTransport(Transport):
    name = "disk-delta"

    def __init__(self, cfg, paths, engines):
        super().__init__(cfg, paths, engines)
        from miles_platform.weights.disk_delta import DeltaPublisher

        self.pub_dir = cfg.update_weight_disk_dir
        self.publisher = DeltaPublisher(
            self.pub_dir,
            encoding=cfg.disk_delta_encoding,
            checksum=cfg.disk_delta_checksum,
            keyframe_interval=cfg.disk_delta_keyframe_interval,
            workers=cfg.disk_delta_encode_workers,
        )
        self.local_root = engine_local_root(cfg)
        self.post_write_hook = None
        if cfg.custom_update_weight_post_write_path:
            from miles_platform.plugins import load_function

            self.post_write_hook = load_function(
                cfg.custom_update_weight_post_write_path, "--custom-update-weight-post-write-path", 3
            )

    def _after_write(self, version: int) -> None:
        """Miles' post-write hook: (args, version_dir, engines), once the version is committed and
        before any engine pulls it (object-store-backed mounts make the files visible here)."""
        if self.post_write_hook is not None:
            from miles_platform.weights.disk_delta import version_dir_name

            self.post_write_hook(
                self.cfg, os.path.join(self.pub_dir, version_dir_name(version)), list(self.engines)
            )

    def local_dir(self, i: int) -> str:
        return os.path.join(self.local_root, f"engine_{i:02d}")

    def snapshot_base(self, state, version: int) -> None:
        """First update: publish the base snapshot and materialize it in every engine-local dir."""
        from miles_platform.weights.disk_delta import apply_publication

        self.publisher.publish(split_fused_experts(state), version=version)
        self._after_write(version)
        for i in range(len(self.engines)):
            self._materialize_base(i)
            apply_publication(self.pub_dir, self.local_dir(i), version=version)

    def _materialize_base(self, i: int) -> None:
        from miles_platform.training.export import export_hf_dir

        d = self.local_dir(i)
        if not os.path.exists(os.path.join(d, "config.json")):
            export_hf_dir({}, self.cfg.hf_checkpoint, d)
            os.remove(os.path.join(d, "model.safetensors"))

    def load_export(self, hf_dir: str, version: int) -> None:
        """A resumed run's first sync. The publication dir is append-only and may already hold
        versions made after the checkpoint (before a crash), so the checkpoint's version is not
        republished: engines load its HF export from disk. The next update publishes a new version
        on top of LATEST, and each engine-local dir catches up to it from whatever it holds."""
        for i, e in enumerate(self.engines):
            self._materialize_base(i)  # config + tokenizer, for the patches to come
            update_from_disk(e.url, hf_dir, version, self.cfg.api_key)

    def prepare(self, state, version, hf_dir):
        from miles_platform.weights.disk_delta import apply_publication

        st = self.publisher.publish(split_fused_experts(state), version=version)  # the export's layout
        self._after_write(version)
        for i in range(len(self.engines)):
            apply_publication(self.pub_dir, self.local_dir(i), version=version)
        n = len(self.engines)
        stats = TransferStats(wire_bytes=st.wire_bytes * n, full_bytes=st.full_bytes * n)
        stats.extra["perf/update_weights_encode_time"] = st.encode_seconds  # in memory
        stats.extra["perf/update_weights_publish_time"] = st.seconds  # encode + write + fsync + commit
        return stats

    def activate(self, version):
        for i, e in enumerate(self.engines):
            update_from_disk(e.url, self.local_dir(i), version, self.cfg.api_key)
