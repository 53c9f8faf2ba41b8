"""Shard URL patterns: brace expansion, ``::`` lists, paths relative to a root (no heavy
imports)."""

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
    """Local shard paths that do not exist."""
    return [u for u in urls if not u.startswith(REMOTE) and not os.path.exists(u)]


def unusable_local_shards(urls: list[str]) -> list[str]:
    """Local shard paths that exist but cannot be read as a tar file, each with the reason."""
    bad = []
    for u in urls:
        if u.startswith(REMOTE) or not os.path.exists(u):
            continue
        if os.path.isdir(u):
            bad.append(f"{u} is a directory, not a shard file")
        elif not os.path.isfile(u):
            bad.append(f"{u} is not a regular file")
        elif not os.access(u, os.R_OK):
            bad.append(f"{u} is not readable (permissions)")
    return bad
