"""The demo's child processes: started so that none outlives the demo, whatever stops it.

``bytescale demo`` runs ``torchrun``, which runs one worker per rank (each in its own session).
Three things keep the process tree from leaking:

* :func:`run_supervised` starts torchrun in its own session, so a terminal's Ctrl-C reaches the
  demo only, and forwards SIGINT/SIGTERM/SIGHUP to it: torchrun stops its workers on those
  signals. If torchrun has not exited ``grace_s`` seconds later it is killed.
* torchrun and every worker call :func:`die_with_parent`: Linux sends them SIGTERM when their
  parent dies, so even a demo killed with SIGKILL leaves nothing training behind.

The children's stdout and stderr reach the terminal through the demo, which relays them until
a signal arrives and drops them after: on Ctrl-C every worker and torchrun itself print a
traceback of the interrupted call (hundreds of lines), and the demo's one line says it all.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Sequence, TextIO

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RESULTS_ENV = "BYTESCALE_DEMO_RESULTS"
"""Where rank 0 leaves results.json for the launcher, which writes the output directory."""
PROGRESS_BAR_ENV = "BYTESCALE_DEMO_PROGRESS_BAR"
"""Set to 1 when the launcher's stderr is a terminal: rank 0 then draws its progress bar."""
_PR_SET_PDEATHSIG = 1


class Interrupted(Exception):
    """The demo was stopped by a signal; its children are gone."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def run_supervised(command: Sequence[str], *, env: dict[str, str], grace_s: float = 30.0) -> int:
    """Run ``command`` to its end and return its exit code; raise :class:`Interrupted` if a
    signal stopped the demo (after the child, and through it its workers, stopped). The
    child's output is relayed until the signal, then dropped (see the module docstring)."""
    process = subprocess.Popen(list(command), env=env, start_new_session=True,
                               preexec_fn=die_with_parent, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    received: list[int] = []
    deadline = [float("inf")]
    relays = [threading.Thread(target=_relay, args=(pipe, stream, received), daemon=True)
              for pipe, stream in ((process.stdout, sys.stdout), (process.stderr, sys.stderr))]
    for relay in relays:
        relay.start()

    def forward(signum: int, _frame: object) -> None:
        if not received:
            deadline[0] = time.monotonic() + grace_s
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            try:
                code = process.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline[0]:
                process.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if process.poll() is None:  # an exception of our own: never leave it running
            process.kill()
            process.wait()
        for relay in relays:  # the workers die with torchrun, closing the pipes
            relay.join(timeout=10.0)
    if received:
        raise Interrupted(received[0])
    return code


def _relay(pipe: IO[bytes], stream: TextIO, stop: list[int]) -> None:
    """Copy ``pipe`` to ``stream`` as it comes, until ``stop`` is non-empty; drain it after."""
    target = getattr(stream, "buffer", None)
    fd = pipe.fileno()
    broken = False
    while chunk := os.read(fd, 65536):
        if stop or broken:
            continue
        try:
            if target is not None:
                stream.flush()
                target.write(chunk)
                target.flush()
            else:  # a text-only stream (e.g. captured by a test)
                stream.write(chunk.decode("utf-8", errors="replace"))
                stream.flush()
        except (OSError, ValueError):  # our own output closed: keep draining the child's
            broken = True
    pipe.close()
