"""How much the CLI says besides its answer: `-v` (info, `-vv` debug, from FreeToken's loggers), `-q`
(errors only: no warnings, no progress or banners). Set once by the root command, as the level of
FreeToken's logger (where Python keeps verbosity); commands ask `quiet()`. Colour follows rich, which
turns it off under `NO_COLOR` and when output is not a terminal."""

from __future__ import annotations

import logging
import sys
import warnings

LOGGER = "freetoken"


def configure(verbose: int, quiet: bool) -> None:
    """Route FreeToken's log records to stderr as `freetoken: message` lines at the chosen level."""
    level = logging.ERROR if quiet else {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level)
    if not any(getattr(h, "freetoken_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("freetoken: %(message)s"))
        handler.freetoken_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    if quiet:
        warnings.simplefilter("ignore")


def quiet() -> bool:
    """Whether `-q` was asked (FreeToken's logger set to errors only)."""
    return logging.getLogger(LOGGER).getEffectiveLevel() >= logging.ERROR
