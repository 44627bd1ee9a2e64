"""A small storage root for the viewer's tests, written with the store's own writers (rollout shards,
`policy_versions` rows) plus a hand-written `train_samples` part file in the store's table layout:

- run `demo`: rollouts 0 and 1, 2 groups x 4 samples each (rewards 0 / 0.5 / 1, one truncated
  sample per group, metadata `source`), versions 1 and 2 trained on them, a byte-level BPE
  tokenizer in its HF dir, and `train_samples` rows for rollout 1;
- run `agent`: a multi-turn episode with a tool call, OPD teacher log-probs and R3 routes;
- run `diffusion`: 4 samples with an image each.
"""

from __future__ import annotations

import io
import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq

from miles_platform.data.sample import Sample, make_turn
from miles_platform.store.paths import StoragePaths, partition_key
from miles_platform.store.shards import write_rollout_shard
from miles_platform.store.tables import append_rows

TRAIN_SAMPLES_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("rollout_id", pa.int64()),
        ("index", pa.int64()),
        ("version", pa.int64()),
        ("step", pa.int64()),
        ("micro_batch", pa.int64()),
        ("rank", pa.int64()),
        ("advantage", pa.list_(pa.float64())),
        ("log_probs", pa.list_(pa.float64())),
        ("rollout_log_probs", pa.list_(pa.float64())),
        ("ratio", pa.list_(pa.float64())),
        ("clipped", pa.list_(pa.bool_())),
        ("ref_kl", pa.list_(pa.float64())),
        ("loss_mask", pa.list_(pa.int64())),
    ]
)
ANSWERS = [
    "2 + 2 means two and then two more.\nCounting on from two: three, four.\nThe answer is 4.",
    "I think it is 5, no wait, 4.",
    "4",
    "Let me count: one two three four five six seven eight nine ten eleven twelve",
]


def tokenizer(hf_dir: str):
    """A byte-level BPE saved as `tokenizer.json` in `hf_dir` (what the viewer loads), trained in ms."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(ANSWERS * 4 + ["What is 2+2?", "search calculator result"], trainer=trainer)
    os.makedirs(hf_dir, exist_ok=True)
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    return tok


def _demo_samples(tok, rollout_id: int) -> list[Sample]:
    out = []
    for i in range(8):
        text = ANSWERS[i % 4]
        ids = tok.encode(text).ids
        truncated = i % 4 == 3
        out.append(Sample(
            rollout_id=rollout_id, group_index=i // 4, index=i, prompt=f"What is 2+2? (group {i // 4})",
            prompt_tokens=tok.encode("What is 2+2?").ids, response=text, response_tokens=ids,
            rollout_log_probs=[-0.1 * (k + 1) for k in range(len(ids))], loss_mask=[1] * len(ids),
            label="4", reward=[1.0, 0.5, 1.0, 0.0][i % 4] if rollout_id else [0.0, 0.0, 1.0, 0.0][i % 4],
            status="truncated" if truncated else "completed", weight_version_start=rollout_id,
            weight_version_end=rollout_id, metadata={"source": "gsm8k" if i % 2 else "math"},
        ))  # fmt: skip
    return out


def write_train_samples(paths: StoragePaths, run: str, rollout_id: int, samples: list[Sample]) -> str:
    """One part file of `train_samples` rows for `samples`, as tables.append_rows lays them out."""
    rows = []
    for s in samples:
        n = len(s.response_tokens)
        adv = 1.0 if s.raw_reward is None and (s.reward or 0) > 0.6 else -0.5
        rows.append({
            "run": run, "rollout_id": rollout_id, "index": s.index, "version": rollout_id + 1, "step": rollout_id,
            "micro_batch": s.index // 4, "rank": 0, "advantage": [adv] * n,
            "log_probs": [lp + 0.3 * math.sin(1.7 * k + s.index) for k, lp in enumerate(s.rollout_log_probs)],
            "rollout_log_probs": list(s.rollout_log_probs), "ratio": [1.0] * n,
            "clipped": [k == 0 for k in range(n)], "ref_kl": [0.01] * n, "loss_mask": [1] * (n - 1) + [0],
        })  # fmt: skip
    directory = paths.join("tables", "train_samples", f"run={run}")
    os.makedirs(directory, exist_ok=True)
    path = f"{directory}/part-00000000000000000001-viewer00.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=TRAIN_SAMPLES_SCHEMA).drop_columns(["run"]), path)
    return path


def _png(shade: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (shade, 255 - shade, 128)).save(buf, format="PNG")
    return buf.getvalue()


def build_viewer_root(root: str, train_samples: bool = True) -> StoragePaths:
    paths = StoragePaths(root)
    hf = paths.hf_export("demo", 1)
    tok = tokenizer(hf)
    for rid in (0, 1):
        samples = _demo_samples(tok, rid)
        shard = write_rollout_shard(paths, "demo", rid, samples)
        append_rows(paths, "policy_versions", "demo", [{
            "version": rid + 1, "partition_key": partition_key("demo", rid + 1), "parent_version": rid,
            "rollout_id": rid, "hf_path": hf, "shard_path": shard.path, "shard_rows": shard.rows,
            "mean_reward": shard.mean_reward, "content_hash": f"h{rid}", "config_hash": "c",
        }])  # fmt: skip
        if rid == 1 and train_samples:
            write_train_samples(paths, "demo", rid, samples)
    call = {"name": "calculator", "arguments": json.dumps({"expr": "2+2"}), "result": "4"}
    turns = [
        make_turn("assistant", "search calculator", 0, 3, "stop", [call]),
        make_turn("tool", "result 4", 3, 5, None, [call]),
        make_turn("assistant", "The answer is 4.", 5, 9, "length"),
    ]
    prompt = [1, 2]
    agent = Sample(
        rollout_id=0, group_index=0, index=0, prompt="What is 2+2? Use the calculator.", prompt_tokens=prompt,
        response="search calculator result 4 The answer is 4.", response_tokens=list(range(10, 19)),
        rollout_log_probs=[-0.3] * 9, loss_mask=[1, 1, 1, 0, 0, 1, 1, 1, 1], reward=1.0, turns=turns,
        teacher_log_probs=[-0.1, -2.0, -0.2, 0, 0, -0.1, -0.5, -0.1, -0.1], opd_reverse_kl=[0.1] * 9,
        rollout_routed_experts=[[[p % 4, (p + 1) % 4], [0, 1]] for p in range(len(prompt) + 9 - 1)],
    )  # fmt: skip
    write_rollout_shard(paths, "agent", 0, [agent])
    images = [
        Sample(rollout_id=0, group_index=i // 2, index=i, prompt="a red square", response="", image_png=_png(40 * i),
               reward=0.25 * i, diffusion_steps=[0, 1], diffusion_log_probs=[-1.0, -2.0])
        for i in range(4)
    ]  # fmt: skip
    write_rollout_shard(paths, "diffusion", 0, images)
    _vlm_run(paths)
    return paths


def _vlm_run(paths: StoragePaths) -> None:
    """A vision-language run: its prompt data (JSONL, a data URI per row) and the run_config.json
    that names it, and one sample that saw the second row's image."""
    import os

    from miles_platform.data.images import to_data_uri

    uris = [to_data_uri(_png(s)) for s in (10, 200)]
    data = os.path.join(paths.root, "vl.jsonl")
    with open(data, "w") as f:
        f.writelines(
            json.dumps({"prompt": "How many in <image>?", "label": "1", "images": [u]}) + "\n" for u in uris
        )
    os.makedirs(paths.checkpoints("vlm"), exist_ok=True)
    with open(os.path.join(paths.checkpoints("vlm"), "run_config.json"), "w") as f:
        json.dump({"prompt_data": data, "input_key": "prompt", "multimodal_keys": '{"image": "images"}'}, f)
    s = Sample(rollout_id=0, group_index=0, index=0, prompt="How many in <image>?", prompt_tokens=[1, 2],
               response=" 1", response_tokens=[3], rollout_log_probs=[-0.5], loss_mask=[1], reward=1.0,
               image_data=[uris[1]])  # fmt: skip
    write_rollout_shard(paths, "vlm", 0, [s])
