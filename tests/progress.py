"""Progress lines for the gate's long checks, on the terminal even while pytest captures.

pytest captures a test's output (file descriptors 1 and 2 included), so a ``print`` in a
fixture that runs for minutes shows nothing until it fails, and the gate looks hung. These
lines go through pytest's terminal reporter with capturing suspended, as pytest's own
output does; without a terminal reporter (``-p no:terminal``) they go nowhere.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


def progress(config: pytest.Config) -> Callable[[str], None]:
    """A function that writes one line to the terminal now, whatever the capturing."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        if reporter is None:
            return
        if capture is None:
            reporter.write_line(line)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    return say
