"""Doctor rows for ``cuda_graphs``."""

from gradsafe.doctor import Check, Outcome

_PENDING = Outcome(None, "not implemented yet")

CHECKS = (Check("cuda_graphs", "cuda_graphs", lambda: _PENDING, lambda: _PENDING),)
