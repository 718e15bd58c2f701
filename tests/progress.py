"""Progress lines for the gate's long checks, on the terminal even while pytest captures.

pytest captures a test's output (file descriptors 1 and 2 included), so a ``print`` in a
fixture that runs for minutes shows nothing until it fails, and the gate looks hung. These
lines go through pytest's terminal reporter with capturing suspended, as pytest's own
output does; without a terminal reporter (``-p no:terminal``) they go nowhere.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import pytest


def progress(config: pytest.Config) -> Callable[[str], None]:
    """A function that writes one line to the terminal now, whatever the capturing."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    # A pytest-xdist worker's reporter writes to the channel back to the controller, which
    # shows only results: there the line goes to the worker's own standard error, which is
    # the terminal's (capturing suspended, as below).
    on_worker = hasattr(config, "workerinput")

    def say(line: str) -> None:
        if on_worker:
            stream = sys.__stderr__
            if stream is not None:
                with _suspended(capture):
                    stream.write(line + "\n")
                    stream.flush()
            return
        if reporter is None:
            return
        if capture is None:
            reporter.write_line(line)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    return say


@contextlib.contextmanager
def _suspended(capture: object) -> Iterator[None]:
    if capture is None:
        yield
        return
    with capture.global_and_fixture_disabled():  # type: ignore[attr-defined]
        yield
