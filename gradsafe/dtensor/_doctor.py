"""Doctor rows for ``dtensor``."""

from gradsafe.doctor import Check, Outcome

_PENDING = Outcome(None, "not implemented yet")

CHECKS = (Check("dtensor", "dtensor", lambda: _PENDING, lambda: _PENDING),)
