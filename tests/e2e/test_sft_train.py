"""`miles-platform train --loss-type sft_loss` as Miles runs SFT (its run-*-sft.sh): the SFT rollout
function over multi-turn `messages` data, no engine, router or weight sync, trainer ranks on Ray;
policy versions, checkpoints, metrics and lineage recorded as for an RL run."""

from __future__ import annotations

import json
import os

from loop_helpers import sft_argv, write_chat_data

from miles_platform.loop import cli_main
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths


def test_train_sft_loss_on_chat_data_records_versions_and_lowers_the_loss(
    tiny_hf_checkpoint, tmp_path, capsys
):
    root, save = tmp_path / "root", tmp_path / "ckpt"
    argv = sft_argv(tiny_hf_checkpoint, write_chat_data(tmp_path), "--num-rollout", "4", "--lr", "1e-2",
                    "--actor-num-gpus-per-node", "2", "--num-cpus-per-actor", "0.5", "--storage-root", str(root),
                    "--run-name", "sft", "--save", str(save), "--save-interval", "2")  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "engines http" not in out  # no engine, router or weight sync started
    res = json.loads(out.strip().splitlines()[-1])
    assert res["final_version"] == 4 and res["final_hf_path"].endswith("v000004")
    assert os.path.exists(os.path.join(res["final_hf_path"], "model.safetensors"))
    cat = Catalog(StoragePaths(str(root)))
    _, pv = cat.query(
        "select version, parent_version, rollout_id, checkpoint_path from policy_versions order by 1"
    )
    assert [r[:3] for r in pv] == [(1, 0, 0), (2, 1, 1), (3, 2, 2), (4, 3, 3)]
    assert [r[3] is not None for r in pv] == [False, True, False, True]  # --save-interval 2
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"  # iter_0000003: rollout 3
    _, loss = cat.query("select rollout_id, value from metrics where name = 'train/loss' order by 1")
    assert len(loss) == 4 and loss[-1][1] < 0.8 * loss[0][1], loss
    # both ranks trained each rollout's samples under the version their step made
    _, ts = cat.query("select rollout_id, version, count(distinct rank), count(*) from train_samples "
                      "where run = 'sft' group by all order by 1")  # fmt: skip
    assert ts == [(r, r + 1, 2, 4) for r in range(4)]
    _, lineage = cat.query("select count(*) from lineage where run = 'sft'")
    assert lineage[0][0] > 0
