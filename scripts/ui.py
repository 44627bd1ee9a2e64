"""`make ui`: `dagster dev` that stops as a whole on Ctrl-C, SIGTERM or SIGHUP.

Left to itself, `dagster dev` started from make in the background ignores SIGINT (a background
shell's children inherit SIG_IGN), and on SIGTERM its daemon shuts down while the webserver, the
code server and dagster dev itself stay up (measured: all five processes alive 30 s later). This
wrapper runs it in its own process group with SIGINT restored, and on any of those signals sends
SIGINT to the group (dagster's own shutdown), then SIGTERM after 10 s and SIGKILL after 5 more,
so nothing it started is left behind. Arguments go to `dagster dev`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = (10.0, 5.0)  # after SIGINT, after SIGTERM


def _stop(group: int, proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, GRACE_S[0]), (signal.SIGTERM, GRACE_S[1])):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)  # anyone of the group left?
            except ProcessLookupError:
                proc.wait()
                return
            proc.poll()
            time.sleep(0.2)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: list[str]) -> int:
    dagster = str(Path(sys.executable).with_name("dagster"))
    proc = subprocess.Popen(
        [dagster, "dev", *argv],
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - before exec only
    )
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    while proc.poll() is None and not stopped:
        time.sleep(0.2)
    _stop(proc.pid, proc)  # also when dagster dev exited by itself: its children go with it
    if stopped:
        print(f"\nmake ui: stopped dagster dev (signal {signal.Signals(stopped[0]).name})", file=sys.stderr)
        return 128 + stopped[0]
    return proc.returncode or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
