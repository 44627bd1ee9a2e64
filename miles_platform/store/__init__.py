"""Store: paths under the storage root, rollout shards, append-only tables, the DuckDB catalog."""
