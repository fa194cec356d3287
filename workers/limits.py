"""Bounds of job parameters that the API checks before a job exists: torch-free, so a request
handler can read them without importing a model package."""

from __future__ import annotations

MAX_NEW_TOKENS = 1024
"""Most tokens one text job generates."""
