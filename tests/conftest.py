"""Shared fixtures. `../shared` (beside the repository root) holds the reference code and
vocabulary; tests that need it skip with a reason where it is absent."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TFGPT2_SHARED", ROOT.parent / "shared"))
REFERENCE_SRC = SHARED / "openai-gpt-2" / "src"


def require_reference():
    """Skip the calling test where OpenAI's reference code is not available."""
    if not (REFERENCE_SRC / "model.py").is_file():
        pytest.skip(f"reference code not found at {REFERENCE_SRC} (set TFGPT2_SHARED)")
    return REFERENCE_SRC
