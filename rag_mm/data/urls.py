"""Shard URL patterns: brace expansion, ``::`` lists, paths relative to a root (no heavy imports)."""

from __future__ import annotations

import os

import braceexpand

REMOTE = ("pipe:", "http:", "https:", "s3:", "gs:")


def expand_urls(root: str, pattern: str) -> list[str]:
    """Brace-expand ``pattern`` (``::`` separates several); relative paths are under ``root``."""
    urls = []
    for part in pattern.split("::"):
        for url in braceexpand.braceexpand(part):
            if url.startswith(REMOTE) or url.startswith("/") or not root:
                urls.append(url)
            else:
                urls.append(os.path.join(root, url))
    return urls


def missing_local_shards(urls: list[str]) -> list[str]:
    return [u for u in urls if not u.startswith(REMOTE) and not os.path.isfile(u)]
