"""Where the seed files are: ``../shared/seeds`` beside the repository root (as in a fresh clone in CI).

A test that needs a seed skips only when that folder does not exist; a folder that
exists but lacks the file, or a file that cannot be read, fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SEEDS_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"


def seed_path(prefix: str) -> Path:
    """The seed file ``<prefix>_*.txt``: skip when the seeds folder is absent, fail when unreadable."""
    if not SEEDS_DIR.exists():
        pytest.skip(f"no seeds folder at {SEEDS_DIR}")
    try:
        hits = sorted(SEEDS_DIR.glob(f"{prefix}_*.txt"))
        if not hits:
            pytest.fail(f"seeds folder {SEEDS_DIR} exists but has no {prefix}_*.txt")
        with open(hits[0], "rb") as fh:
            if not fh.read(1):
                pytest.fail(f"seed {hits[0]} is empty")
    except OSError as e:
        pytest.fail(f"seeds folder {SEEDS_DIR} exists but cannot be read: {e}")
    return hits[0]
