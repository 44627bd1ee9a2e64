"""Disk-delta weight publication (Miles `--update-weight-transfer-mode disk-delta`).

Layout of a publication dir (shared storage, one writer, any number of readers):

    LATEST                      committed version, one integer line; replaced atomically, written last
    weight_vNNNNNN/index.json   version, base_version, kind, encoding, checksum, compression, tensors[]
    weight_vNNNNNN/payload.bin  per changed tensor, its sections (zstd frames or raw); index gives byte ranges
    .publish.lock               held (O_CREAT|O_EXCL, "pid host") while a publisher writes

Filters (format /3): xor deltas go through `lowbits` (default, `kernels/lowbits.py`): every
element's XOR packed to its low L bits (L per tensor, from a sample) plus the positions and high parts
of the few elements that need more; written and applied by vectorized loops at a fraction of
memcpy's cost. Snapshots (and xor deltas under `filter="byteplane"`, the smallest wire) go through
the byte-plane filter (`kernels/byteplane.py`): byte k of every element in plane k, each plane stored
as nothing (all zero), a bitmap + its nonzero bytes (sparse) or itself (dense), zstd where it pays.

Kinds: `snapshot` (every tensor's bytes; the first version and every `keyframe_interval`-th) and
`delta` against `base_version`, encoded `xor` (bytewise XOR: compact, apply exactly once to the
base) or `overwrite` (changed element positions + new values: idempotent). Each tensor entry
records name/dtype/shape and the checksum of its FINAL bytes; appliers verify lineage, layout
and every final checksum before anything becomes visible, and fail closed with PublicationError.
A version is committed when LATEST names it; version dirs above LATEST are leftovers of a crash
between rename and pointer update and are ignored by readers and removed by the next publisher.

Publishing lives in `delta_publish.py` (`DeltaPublisher`), applying in `delta_apply.py`
(`apply_publication`, `apply_to_state_dict`), the on-disk names and codecs in `delta_format.py`;
this module is their public face.
"""

from miles_platform.weights.delta_apply import (  # noqa: F401  (re-exported)
    PIPELINE_WEIGHTS,
    apply_publication,
    apply_to_state_dict,
    plan_catch_up,
    read_local_version,
    weights_file,
)
from miles_platform.weights.delta_format import (  # noqa: F401  (re-exported: the format's public names)
    COMPRESSIONS,
    ENCODINGS,
    FILTERS,
    FORMAT,
    INDEX,
    LATEST,
    LOCK,
    PAYLOAD,
    VERSION_FILE,
    VERSION_META_KEY,
    WEIGHTS_FILE,
    Codec,
    committed_versions,
    list_publications,
    read_index,
    read_latest,
    version_dir_name,
)
from miles_platform.weights.delta_publish import DeltaPublisher, PublishStats  # noqa: F401  (re-exported)
