"""The 'spindle' logger: INFO to stderr by default, SPINDLE_LOG_LEVEL to change it."""

from __future__ import annotations

import logging
import os


def configure_logging() -> logging.Logger:
    logger = logging.getLogger("spindle")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("SPINDLE_LOG_LEVEL", "INFO").upper())
        logger.propagate = False
    return logger
