"""The named indexes one search server answers for, each swapped whole for the newer version ``index build``
commits, and this server's path of an indexed image. ``search/api.py`` and its clip-retrieval routes
(``search/clip_retrieval.py``) serve them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

from fastapi import HTTPException

from openalign.search.query import Searcher


def index_version(root: Path) -> tuple[int, int, int] | None:
    """What changes when ``index build`` commits to the index at ``root``: it moves a new ``index.json`` into
    place after every other file, so its inode, modification time and size mark a complete new version."""
    try:
        st = (root / "index.json").stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Indexes:
    """The named searchers one server answers for; the first is the default.

    With ``reload_check_s`` ≥ 0, a request looks (at most once in that many seconds per index) whether
    ``index build`` has committed a new version of its index; if so the new version is opened in a background
    thread beside the old one and swapped in whole. A request keeps the searcher it started with, so none
    sees half of one version and half of another; a version that does not open keeps the old one served. A
    searcher holds its files open, so a version swapped out or deleted keeps answering the requests it took.
    """

    def __init__(self, searchers: Searcher | Mapping[str, Searcher], *, reload_check_s: float = -1.0):
        if isinstance(searchers, Searcher):
            searchers = {searchers.index.root.name or "default": searchers}
        if not searchers:
            raise ValueError("a server needs at least one index")
        self.searchers = dict(searchers)
        self.default = next(iter(self.searchers))
        self.reload_check_s = reload_check_s
        self._versions = {name: index_version(s.index.root) for name, s in self.searchers.items()}
        self._checked = dict.fromkeys(self.searchers, time.monotonic())
        self._reloading: set[str] = set()
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self.searchers)

    def get(self, name: str | None) -> tuple[str, Searcher]:
        """The searcher called ``name`` (the default for None); HTTPException 404 naming the others."""
        name = name or self.default
        if name not in self.searchers:
            raise HTTPException(404, f"no index named {name!r}; this server has {', '.join(self.searchers)}")
        if self.reload_check_s >= 0:
            self._check(name)
        return name, self.searchers[name]

    def _check(self, name: str) -> None:
        now = time.monotonic()
        with self._lock:
            if name in self._reloading or now - self._checked[name] < self.reload_check_s:
                return
            self._checked[name] = now
            version = index_version(self.searchers[name].index.root)
            if version is None or version == self._versions[name]:
                return
            self._reloading.add(name)
        threading.Thread(target=self._reload, args=(name, version), daemon=True).start()

    def _reload(self, name: str, version: tuple[int, int, int]) -> None:
        import sys

        old = self.searchers[name]
        try:
            fresh = old.reopened()
        except (OSError, ValueError) as err:
            # A build committing again while this one opened, or a damaged file: keep serving the old version
            # and look again at the next check.
            print(f"warning: index {name!r} not reloaded: {err}", file=sys.stderr)
            with self._lock:
                self._reloading.discard(name)
            return
        with self._lock:
            # A version replaced while it opened may mix two versions' files: the next check opens the newer one.
            if index_version(old.index.root) == version:
                self.searchers[name] = fresh  # one reference swapped: requests under way keep the old searcher
                self._versions[name] = version
            self._reloading.discard(name)

    def image_path(self, name: str, image_id: int) -> str:
        """This server's path of image ``image_id`` of index ``name``."""
        return f"/image/{image_id}" if name == self.default else f"/image/{image_id}?index={name}"
