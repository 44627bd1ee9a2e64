"""`miles-platform` as a process ends as Python's exit would, less the teardown of every module and
object at the very end (cli.exit_now): non-daemon threads finish, atexit handlers run, buffered
output is written, the status is the command's; nothing that runs only in that teardown runs."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from miles_platform.cli import exit_now

    class Teardown:
        def __del__(self):
            print("teardown ran", flush=True)

    kept = Teardown()  # a module global: collected only when the interpreter tears itself down
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.stdout.write("buffered, ")  # no newline, no flush
    exit_now(3)
    print("never")
    """
)


def test_exit_now_keeps_what_python_exit_does_first_and_skips_the_teardown():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert r.stdout.startswith("buffered, ") and "thread done" in r.stdout and "atexit ran" in r.stdout
    assert r.stdout.index("thread done") < r.stdout.index("atexit ran")  # threads first, as Python does
    assert "teardown ran" not in r.stdout and "never" not in r.stdout


def test_the_cli_process_exits_with_its_commands_status():
    run = lambda *a: subprocess.run([sys.executable, "-m", "miles_platform.cli", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
    ok, unknown = run("help"), run("no-such-command")
    assert ok.returncode == 0 and "quickstart" in ok.stdout
    assert unknown.returncode == 2 and "unknown command 'no-such-command'" in unknown.stderr
