"""Server test fixtures; the helpers live in ``server_helpers.py``."""

from __future__ import annotations
