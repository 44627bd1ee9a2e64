"""No flag of `train`, `train-diffusion` or `eval` changes its name, default, type, choices or group,
and no Launchpad field its default, by accident: the surface is compared with flag_surface.json.
After a deliberate change (a new flag, a new default) refresh it: python scripts/flag_surface.py --write"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_flag_surface_matches_the_recorded_one():
    sys.path.insert(0, str(ROOT / "scripts"))
    from flag_surface import GOLDEN, dumps, surface

    now, recorded = json.loads(dumps(surface())), json.loads(GOLDEN.read_text())
    for command in ("train", "train_diffusion", "eval"):
        was = {a["dest"]: a for a in recorded[command]["actions"]}
        is_ = {a["dest"]: a for a in now[command]["actions"]}
        changed = {d: (was.get(d), is_.get(d)) for d in was.keys() | is_.keys() if was.get(d) != is_.get(d)}
        assert not changed, f"`{command}` flags differ from {GOLDEN.name} (recorded, now): {changed}"
        assert list(was) == list(is_), f"`{command}` flags are in another order than in {GOLDEN.name}"
    for table in ("run_config_defaults", "diffusion_run_config_defaults", "launchpad_defaults"):
        was, is_ = recorded[table], now[table]
        changed = {k: (was.get(k), is_.get(k)) for k in was.keys() | is_.keys() if was.get(k) != is_.get(k)}
        assert not changed, f"{table} differ from {GOLDEN.name} (recorded, now): {changed}"
        assert list(was) == list(is_), f"{table}: fields in another order than in {GOLDEN.name}"
