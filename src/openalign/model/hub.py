"""Hugging Face hub ids (``org/name`` or ``hf-hub:org/name``), resolved through the local cache only.

Nothing is ever downloaded here: a model fetched once with ``hf download org/name`` (or by transformers) lies
in the hub cache as ``models--org--name/snapshots/<revision>/``, and ``refs/main`` names the revision. The cache
is located from the environment at call time, as huggingface_hub documents it (``HF_HUB_CACHE``, else
``HF_HOME``/hub, else ``$XDG_CACHE_HOME``/huggingface/hub, else ~/.cache/huggingface/hub), so a process that
changes ``HF_HOME`` after importing huggingface_hub still looks where it says.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

HUB_PREFIX = "hf-hub:"
# owner/name as the hub spells them: one slash, no "..", no leading punctuation.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_id(name: str) -> str | None:
    """The repository id ``name`` names (``hf-hub:`` stripped), or None when it cannot be one."""
    repo = name[len(HUB_PREFIX) :] if name.startswith(HUB_PREFIX) else name
    if not _REPO_ID.match(repo) or ".." in repo:
        return None
    return repo


def hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface"


def hub_cache() -> Path:
    """The directory that holds ``models--org--name`` folders."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return hf_home() / "hub"


def download_command(repo: str) -> str:
    """How the installed huggingface_hub spells a download: ``hf`` from 0.34 on (the only one from 1.0)."""
    try:
        major, minor = (int(x) for x in re.findall(r"\d+", metadata.version("huggingface_hub"))[:2])
    except (metadata.PackageNotFoundError, ValueError):
        major, minor = 1, 0
    cli = "hf" if (major, minor) >= (0, 34) else "huggingface-cli"
    return f"{cli} download {repo}"


def _where() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return f"HF_HUB_CACHE={hub_cache()}"
    return f"HF_HOME={hf_home()}"


def cached_snapshot(repo: str, *, not_a_directory: bool = False) -> Path:
    """The local snapshot directory of hub model ``repo`` (its ``main`` revision); FileNotFoundError, one line
    saying how to fetch it, when the cache does not hold it (and, with ``not_a_directory``, that no local
    directory of that name exists either)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ImportError(
            f"loading {repo} from the Hugging Face cache needs huggingface_hub: pip install huggingface_hub"
        ) from None
    lead = f"{repo}: no such directory, and it" if not_a_directory else repo
    missing = FileNotFoundError(
        f"{lead} is not in the local Hugging Face cache ({_where()}); fetch it with: {download_command(repo)}"
    )
    cache = hub_cache()
    root = cache / f"models--{repo.replace('/', '--')}"
    if not root.is_dir():
        raise missing
    ref = root / "refs" / "main"
    if ref.is_file() and not ref.read_text(errors="replace").strip():
        # huggingface_hub would hand back the snapshots folder itself, and loading would miss its config.json.
        raise FileNotFoundError(
            f"{ref}: empty, so it names no snapshot of {repo} (an interrupted download?); fetch it again with: "
            f"{download_command(repo)}"
        )
    try:
        # local_files_only: never a network request, whatever HF_HUB_OFFLINE says.
        path = snapshot_download(repo, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise missing from None
    return Path(str(path))


def resolve(name_or_path: str | Path) -> Path:
    """A local directory as it is, or the cached snapshot of a hub id; FileNotFoundError (one line) otherwise."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    name = str(name_or_path)
    repo = hub_id(name)
    if repo is None:
        raise FileNotFoundError(f"{name}: no such directory (nor a hub id such as hf-hub:org/name)")
    if not name.startswith(HUB_PREFIX) and path.exists():
        raise FileNotFoundError(f"{name}: not a directory")
    return cached_snapshot(repo, not_a_directory=not name.startswith(HUB_PREFIX))
