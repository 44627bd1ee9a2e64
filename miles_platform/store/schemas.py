"""Every table schema of the store, in one module: rollout shards and the append-only tables.
Writers and the DuckDB catalog import them from here (no module needs another's writer for them)."""

from __future__ import annotations

import pyarrow as pa

# A multi-turn episode's turns (data/sample.py make_turn): spans index response_tokens.
TOOL_CALL_TYPE = pa.struct(
    [("name", pa.string()), ("arguments", pa.string()), ("result", pa.string()), ("error", pa.string())]
)
TURN_TYPE = pa.struct(
    [
        ("role", pa.string()),  # assistant | tool
        ("text", pa.string()),
        ("start", pa.int64()),
        ("end", pa.int64()),
        ("finish_reason", pa.string()),  # assistant turns: stop | length | abort
        ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    ]
)

# One explicit schema from Sample.to_row(): stable column types whatever the first row holds.
ROLLOUT_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("rollout_id", pa.int64()),
        ("group_index", pa.int64()),
        ("index", pa.int64()),
        ("prompt", pa.string()),
        ("prompt_tokens", pa.list_(pa.int64())),
        ("response", pa.string()),
        ("response_tokens", pa.list_(pa.int64())),
        ("response_length", pa.int64()),
        ("rollout_log_probs", pa.list_(pa.float64())),
        ("rollout_sampling_support", pa.list_(pa.list_(pa.int64()))),
        ("loss_mask", pa.list_(pa.int64())),
        ("label", pa.string()),
        ("reward", pa.float64()),
        ("reward_json", pa.string()),
        ("raw_reward", pa.float64()),
        ("status", pa.string()),
        ("weight_version_start", pa.int64()),
        ("weight_version_end", pa.int64()),
        ("metadata", pa.string()),
        ("remove_sample", pa.bool_()),
        ("teacher_log_probs", pa.list_(pa.float64())),  # on-policy distillation (null: not scored)
        ("opd_reverse_kl", pa.list_(pa.float64())),
        ("turns", pa.list_(TURN_TYPE)),  # multi-turn episodes (null: single turn)
        # R3: per token but the last, per layer, the top-k experts the engine routed to (null: dense / off)
        ("rollout_routed_experts", pa.list_(pa.list_(pa.list_(pa.int32())))),
        # diffusion runs: the image (PNG bytes) and per recorded transition its step and log-prob
        ("image_png", pa.binary()),
        ("diffusion_steps", pa.list_(pa.int64())),
        ("diffusion_log_probs", pa.list_(pa.float64())),
        # score centering: per response token the engine's K candidates (id -1 / -inf: unused)
        ("rollout_topk_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("rollout_topk_log_probs", pa.list_(pa.list_(pa.float32()))),
        # vision-language prompts: the content hash of each image the sample saw (null: text only)
        ("image_hashes", pa.list_(pa.string())),
    ]
)


_TS = pa.timestamp("us", tz="UTC")

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "policy_versions": pa.schema(
        [
            ("run", pa.string()),
            ("version", pa.int64()),
            ("partition_key", pa.string()),  # <run>.v<NNNNNN>
            ("parent_version", pa.int64()),
            ("rollout_id", pa.int64()),  # rollout that trained this version
            ("checkpoint_path", pa.string()),
            ("hf_path", pa.string()),
            ("content_hash", pa.string()),  # of the weights
            ("config_hash", pa.string()),  # RunConfig.hash
            ("base_data_version", pa.string()),  # Dagster data version of the base checkpoint
            ("dataset_data_version", pa.string()),  # ... of prompt_dataset
            ("shard_path", pa.string()),
            ("shard_rows", pa.int64()),
            ("mean_reward", pa.float64()),
            ("created_at", _TS),
            ("adapter_path", pa.string()),  # LoRA runs: the version's PEFT adapter dir (hf_path null)
            # the code that made it (store/code_version.py); null in rows written before 2026-12-05
            ("platform_version", pa.string()),  # miles-platform's release
            ("git_commit", pa.string()),  # HEAD of the source checkout (null: not a git checkout)
            ("git_dirty", pa.bool_()),  # tracked files differed from that commit
        ]
    ),
    "evals": pa.schema(
        [
            ("run", pa.string()),
            ("version", pa.int64()),
            ("partition_key", pa.string()),
            ("dataset", pa.string()),
            ("metric", pa.string()),  # pass@1 (greedy), pass@4(T=1), mean_reward@4(T=1), ... (pass@k /
            # mean_reward before 2026-12-05: metric_names.metric_name reads them with n_samples / temperature)
            ("value", pa.float64()),
            (
                "n_samples",
                pa.int64(),
            ),  # responses per prompt behind this metric: n (pass@<n>(T=..), mean_reward@<n>(..)), 1 (greedy)
            ("source", pa.string()),  # the writer: "loop" (--eval-interval in train) | "asset" (eval_results)
            # the sampling behind this metric: the eval's for the sampled metrics; temperature 0,
            # top_p 1, top_k -1 for the greedy pass@1, its breakdowns and tool_call_share (since
            # 2026-12-04; older rows carry the eval's sampling on every metric)
            ("temperature", pa.float64()),
            ("top_p", pa.float64()),
            ("top_k", pa.int64()),
            ("max_new_tokens", pa.int64()),
            ("created_at", _TS),
        ]
    ),
    "lineage": pa.schema(
        [
            ("run", pa.string()),
            ("child", pa.string()),  # key: partition key, path or asset key
            ("child_kind", pa.string()),  # policy_version, checkpoint, rollout_shard, dataset, ...
            ("parent", pa.string()),
            ("parent_kind", pa.string()),
            ("relation", pa.string()),  # trained_from, trained_on, converted_from, ...
            ("data_version", pa.string()),
            ("created_at", _TS),
        ]
    ),
    "metrics": pa.schema(
        [
            ("run", pa.string()),
            ("rollout_id", pa.int64()),
            ("step", pa.int64()),
            ("name", pa.string()),  # Miles metric name: rollout/raw_reward, train/loss, ...
            ("value", pa.float64()),
            ("created_at", _TS),
        ]
    ),
    # what happened to a run besides its rows: a resume (from which checkpoint, which versions it
    # abandoned, which flags it changed under --allow-config-change)
    "run_events": pa.schema(
        [
            ("run", pa.string()),
            ("event", pa.string()),  # resume
            (
                "rollout_id",
                pa.int64(),
            ),  # the checkpoint's rollout: rows of later rollouts made before are abandoned
            ("version", pa.int64()),  # the checkpoint's version: later versions made before are abandoned
            ("detail", pa.string()),  # JSON: abandoned_versions, config_changes, pid, host
            ("created_at", _TS),
        ]
    ),
    # one row per trained sample (training/train_samples.py; --save-train-samples bounds how many),
    # joinable with rollouts on (run, rollout_id, index); per-token lists span the response tokens
    "train_samples": pa.schema(
        [
            ("run", pa.string()),
            ("rollout_id", pa.int64()),
            ("index", pa.int64()),  # the Sample's index in its rollout
            ("version", pa.int64()),  # the policy version its optimizer step made (null: no versions)
            ("step", pa.int64()),  # the trainer's optimizer step (0-based, over the run)
            ("micro_batch", pa.int64()),  # its micro-batch within that step, on its rank
            ("rank", pa.int64()),  # the trainer rank that trained it and wrote the row
            ("advantage", pa.list_(pa.float64())),  # as the loss took it (after OPD and whitening)
            ("log_probs", pa.list_(pa.float64())),  # the training forward's (the gradient's) log-probs
            ("rollout_log_probs", pa.list_(pa.float64())),  # the engine's (null: none recorded)
            ("ratio", pa.list_(pa.float64())),  # pi / pi_old (policy_loss only; 1 at masked tokens)
            ("clipped", pa.list_(pa.bool_())),  # PPO clip active (what train/pg_clipfrac counts)
            ("ref_kl", pa.list_(pa.float64())),  # --kl-loss-type estimate of KL(pi || ref) (null: no ref)
            ("loss_mask", pa.list_(pa.int64())),
            ("created_at", _TS),
        ]
    ),
}

# a compacted table file's extra column: the part file each row was appended in (store/tables.py)
SOURCE_PART = "_source_part"

# rows a resume can abandon (store/run_events.py): table -> the column compared with the resume
# event's (a later version, or a later rollout's metrics)
KEYED_BY = {
    "policy_versions": "version",
    "metrics": "rollout_id",
    "evals": "version",
    "train_samples": "rollout_id",
}
