"""Two runs sharing a --save dir (issue #49, item 11): the second took over the first's checkpoint
and overwrote its run_config.json, so the first could no longer resume. Now the dir has one writer
at a time and names the run it belongs to."""

from __future__ import annotations

import json

import pytest

from miles_platform.config import ConfigError, RunConfig, saved_config
from miles_platform.run_lifecycle import check_resume_config
from miles_platform.store.paths import RUN_CONFIG
from miles_platform.store.run_lock import RunLock, RunLocked, local_save_dir


def test_a_save_dir_of_another_run_is_refused_before_it_is_touched(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    first = RunConfig(rollout_batch_size=1, run_name="first", save=str(save)).validate()
    (save / RUN_CONFIG).write_text(saved_config(first))  # the first run, before its first checkpoint
    second = RunConfig(rollout_batch_size=1, run_name="second", save=str(save)).validate()
    with pytest.raises(ConfigError, match=r"--save .* holds the checkpoints of run 'first', not 'second'"):
        check_resume_config(second, print)
    assert json.loads((save / RUN_CONFIG).read_text())["run_name"] == "first"  # untouched
    assert check_resume_config(first, print) == []  # its own run resumes
    # loading another run's checkpoint into a dir of one's own stays allowed
    third = RunConfig(rollout_batch_size=1, run_name="third", load=str(save), save=str(tmp_path / "own"))
    check_resume_config(third.validate(), print)


def test_one_writer_per_save_dir(tmp_path):
    save = str(tmp_path / "ckpt")
    with RunLock(local_save_dir(save), "first", f"--save {save}"):
        with pytest.raises(
            RunLocked, match=rf"--save {save} is being written by pid \d+ on .* \(run 'first', since"
        ):
            RunLock(local_save_dir(save), "second", f"--save {save}").acquire()
    RunLock(local_save_dir(save), "second", f"--save {save}").acquire().release()  # free again
