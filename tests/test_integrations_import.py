"""``import kvoffload`` (and its integrations package) never imports an engine."""

from __future__ import annotations

import subprocess
import sys


def test_importing_kvoffload_imports_no_engine() -> None:
    code = (
        "import sys, kvoffload, kvoffload.integrations\n"
        "from kvoffload import OffloadManager, Offloader\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang'))\n"
        "print(loaded)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout
