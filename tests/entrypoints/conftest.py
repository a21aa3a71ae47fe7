"""The entry points' tests drive live servers built by tests/api's helpers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "api"))  # api_servers, webhook_servers
