"""Doctor rows for ``pipelining``."""

from gradsafe.doctor import Check, Outcome

_PENDING = Outcome(None, "not implemented yet")

CHECKS = (Check("pipelining", "pipelining", lambda: _PENDING, lambda: _PENDING),)
