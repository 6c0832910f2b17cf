"""When the deprecated names go: one release for every ``DeprecationWarning`` (CHANGELOG.md, deprecation policy)."""

#: The release that removes every name deprecated in 0.3 (renamed in 0.2.0 or 0.3.0).
REMOVED_IN = "0.4.0"


def removal_notice() -> str:
    """The clause every deprecation warning ends with."""
    return f"the old name is removed in gradsafe {REMOVED_IN}"
