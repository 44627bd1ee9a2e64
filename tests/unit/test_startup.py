"""startup.py: the background imports a run's processes start while they wait."""

from __future__ import annotations

import sys


def test_import_in_background_imports_on_a_daemon_thread_and_skips_a_failure(tmp_path, monkeypatch):
    (tmp_path / "warm_mod_a.py").write_text("import time\ntime.sleep(0.2)\nVALUE = 7\n")
    (tmp_path / "warm_mod_b.py").write_text("raise ImportError('broken on purpose')\n")
    (tmp_path / "warm_mod_c.py").write_text("VALUE = 9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("warm_mod_a", "warm_mod_b", "warm_mod_c"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    from miles_platform.startup import import_in_background

    t = import_in_background("warm_mod_a", "warm_mod_b", "warm_mod_c", name="warm-test")
    assert t.daemon and t.name == "warm-test"
    assert t.is_alive()  # returned while the first import still runs (it sleeps)
    t.join(10)
    # a failed import is skipped (it fails again, loudly, where the module is used); the next one runs
    assert sys.modules["warm_mod_a"].VALUE == 7 and sys.modules["warm_mod_c"].VALUE == 9
    assert "warm_mod_b" not in sys.modules


def test_a_run_says_when_every_process_would_compile_its_modules(tmp_path, monkeypatch):
    import importlib.util

    from miles_platform.startup import bytecode_note

    src = tmp_path / "heavy_mod.py"
    src.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode_note("heavy_mod") is None  # .pyc files get written: nothing to say
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    note = bytecode_note("heavy_mod")
    assert note and "PYTHONDONTWRITEBYTECODE is set and heavy_mod has no .pyc" in note
    import py_compile

    py_compile.compile(str(src), cfile=importlib.util.cache_from_source(str(src)))
    assert bytecode_note("heavy_mod") is None  # compiled once: nothing to say
    assert bytecode_note("no_such_module_here") is None


def test_a_clock_that_paused_the_gc_freezes_start_up_and_collects_again_once_started():
    """`miles-platform train`'s process collects no cyclic garbage during start-up (each full
    collection walks everything imported so far); once the first rollout starts, what start-up
    built is frozen out of every later collection and collection resumes."""
    import gc

    from miles_platform.startup import StartupClock

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    clock = StartupClock()
    try:
        clock.pause_gc()
        assert not gc.isenabled()
        kept = [[] for _ in range(1000)]  # start-up's long-lived objects
        clock.started()
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
        clock.started()  # once only
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_a_clock_that_did_not_pause_the_gc_leaves_it_as_the_caller_set_it():
    """A run started in-process (the Dagster op, a test) keeps its process's collector as it was."""
    import gc

    from miles_platform.startup import StartupClock

    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        StartupClock().started()
        assert not gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.enable()
