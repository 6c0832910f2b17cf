"""Doctor rows for ``wgrad``."""

from gradsafe.doctor import Check, Outcome

_PENDING = Outcome(None, "not implemented yet")

CHECKS = (Check("wgrad", "wgrad", lambda: _PENDING, lambda: _PENDING),)
