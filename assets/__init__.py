"""Dagster assets and asset checks, one module per domain."""

import importlib

import dagster as dg

# one module per domain
DOMAINS = (
    "datasets",
    "checkpoints",
    "conversion",
    "rollouts",
    "run_health",
    "evals",
    "scoreboard",
    "weights",
    "diffusion",
    "vlm",
)


def _modules():
    return [importlib.import_module(f"assets.{name}") for name in DOMAINS]


def all_assets():
    """Assets defined with @asset, plus AssetSpecs of assets materialized by ops (rl_training)."""
    mods = _modules()
    specs = [v for m in mods for v in vars(m).values() if isinstance(v, dg.AssetSpec)]
    return list(dg.load_assets_from_modules(mods)) + specs


def all_checks():
    return list(dg.load_asset_checks_from_modules(_modules()))
