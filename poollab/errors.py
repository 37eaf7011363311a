"""Which exceptions are the user's input going wrong (exit 2, one line) rather than a bug."""

from __future__ import annotations

from policies.errors import PolicyError
from traces.errors import TraceFormatError


class UsageError(ValueError):
    """Bad input found by the command layer or a backend (no GPU, unknown model, ...)."""


#: Caught by ``poollab.cli.main``: printed as one line, exit status 2, no traceback. Every
#: ``OSError`` is here: a missing file, ``--out`` under a file, a full disk or a read-only
#: folder are the user's environment, not a bug, and the message names the path.
USER_ERRORS: tuple[type[BaseException], ...] = (PolicyError, TraceFormatError, UsageError, OSError)
