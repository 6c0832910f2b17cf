"""Where a document gradsafe's output names can be read: the checkout's file, or a URL.

``gradsafe doctor`` (and ``gradsafe verify``) name documents such as
``docs/troubleshooting.md``. From a source checkout that path exists beside the
package; after a wheel install it does not, and the name is given as the
project's documentation URL (``Documentation``, else ``Source``/``Repository``/
``Homepage`` among the distribution's ``Project-URL`` metadata), or, where the
installed metadata names none, as the file of the source distribution of
this version (``graft docs`` puts every document there).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

__all__ = ["doc"]

_CHECKOUT_DOCS = Path(__file__).resolve().parents[2] / "docs"
# A Documentation URL is a base for the documents; a repository's needs its tree's path.
_URL_KINDS = (
    ("documentation", "/"),
    ("source", "/blob/main/docs/"),
    ("repository", "/blob/main/docs/"),
    ("homepage", "/blob/main/docs/"),
)


def doc(name: str) -> str:
    """``docs/NAME`` where the checkout has it; else its URL, or where the sdist holds it."""
    docs = _CHECKOUT_DOCS
    if (docs / name).is_file():
        return f"docs/{name}" if Path.cwd() == docs.parent else str(docs / name)
    urls = _project_urls()
    for kind, path in _URL_KINDS:
        if kind in urls:
            return f"{urls[kind].rstrip('/')}{path}{name}"
    version = _version()
    return (
        f"docs/{name} of gradsafe's source distribution (pip download --no-deps --no-binary "
        f":all: gradsafe=={version})"
    )


def _project_urls() -> dict[str, str]:
    """The installed distribution's ``Project-URL`` entries by lower-cased label."""
    try:
        entries = importlib.metadata.metadata("gradsafe").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    pairs = (entry.split(",", 1) for entry in entries if "," in entry)
    return {label.strip().lower(): url.strip() for label, url in pairs}


def _version() -> str:
    try:
        return importlib.metadata.version("gradsafe")
    except importlib.metadata.PackageNotFoundError:
        return "VERSION"
