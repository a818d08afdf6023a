"""The fuzz suite with many more examples and fresh randomness (a soak, bounded in count).

    HOOKWIRE_FUZZ_EXAMPLES=2000 .venv/bin/python tests/bench/fuzz_long.py
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

if __name__ == "__main__":
    os.environ.setdefault("HOOKWIRE_FUZZ_EXAMPLES", "1000")
    os.environ["HOOKWIRE_FUZZ_RANDOM"] = "1"
    root = pathlib.Path(__file__).resolve().parents[2]
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", str(root / "tests" / "integration" / "test_fuzz.py")]))
