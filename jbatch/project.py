"""The project's distribution name and repository address, from ``pyproject.toml``.

``[project.urls] Repository`` is the one place the address is written: the installed package's
metadata carries it, a source checkout reads it from ``pyproject.toml`` beside the package.
Its owner is a placeholder (``YOUR-ORG``) until the repository is published; see the README.
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

DIST_NAME = "jbatch-engine"  # `pip install jbatch-engine`; `import jbatch`; the `jbatch` command
PLACEHOLDER_OWNER = "YOUR-ORG"
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def repository_url() -> str:
    """``[project.urls] Repository``: from ``pyproject.toml`` in a source checkout, else from
    the installed distribution's metadata."""
    if _PYPROJECT.is_file():
        project = tomllib.loads(_PYPROJECT.read_text())["project"]
        if project.get("name") == DIST_NAME:
            return project["urls"]["Repository"]
    for entry in metadata.metadata(DIST_NAME).get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "repository":
            return url.strip()
    raise LookupError(f"{DIST_NAME}: no Repository in [project.urls]")


def is_placeholder(url: str) -> bool:
    """Whether ``url`` still names the placeholder owner (not yet a real repository)."""
    return f"/{PLACEHOLDER_OWNER}/" in url


def colab_url(notebook: str, url: str | None = None, branch: str = "main") -> str:
    """The "Open in Colab" address of ``notebooks/<notebook>`` in a GitHub repository."""
    url = (url or repository_url()).removesuffix(".git").rstrip("/")
    prefix = "https://github.com/"
    if not url.startswith(prefix):
        raise ValueError(f"repository url {url!r}: Colab opens notebooks from github.com only")
    repo = url[len(prefix) :]
    return f"https://colab.research.google.com/github/{repo}/blob/{branch}/notebooks/{notebook}"
