"""One logging setup for every service, so lines from four processes interleave readably."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str) -> logging.Logger:
    level = os.environ.get("MSTAR_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s",
    )
    return logging.getLogger(f"mstar.{service}")
