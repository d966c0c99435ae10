"""Moving a weight store of the earlier nested layout to the flat one, once, at agent start.

The store used to keep ``ORG/NAME`` models at ``<store>/ORG/NAME``: a one-part model named
``ORG`` then *was* the directory holding every ``ORG/...`` model, and retiring it removed them
all.  Now every model is one entry directly under the root
(:func:`warmserve.modelref.store_dirname`: ``<store>/ORG~NAME``).  An ``<store>/ORG/NAME``
directory holding a ``config.json`` (under an ``ORG`` directory that is not itself a model) is
renamed to its new place; the ``ORG`` directory goes when empty.  What cannot be moved (a
read-only store, a name present in both layouts) is refused with the command that moves it: an
agent does not start on a store it would half see, and the fetcher never retires a directory
that is not a model (``store_install``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Protocol

from warmserve.modelref import STORE_SEP, SourceURIError, check_model_name, model_of_store_entry
from warmserve_agent.store_errors import StoreError

log = logging.getLogger("warmserve.agent.store")


class StoreLike(Protocol):
    """What the upgrade needs of :class:`~warmserve_agent.store.WeightStore`."""

    root: Path

    def model_path(self, name: str) -> Path: ...


def upgrade_layout(store: StoreLike) -> list[str]:
    """The names moved from ``<root>/ORG/NAME`` to ``<root>/ORG~NAME``; StoreError naming what
    could not be moved (module docstring)."""
    root = store.root
    if not root.is_dir():
        return []
    moved: list[str] = []
    stuck: list[str] = []
    for org in sorted(root.iterdir()):
        if (
            model_of_store_entry(org.name) is None
            or STORE_SEP in org.name
            or org.is_symlink()
            or not org.is_dir()
            or (org / "config.json").exists()  # a one-part model, not an org directory
        ):
            continue
        for sub in sorted(org.iterdir()):
            name = f"{org.name}/{sub.name}"
            try:
                check_model_name(name)
            except SourceURIError:
                continue
            if not (sub / "config.json").is_file():
                continue
            dest = store.model_path(name)
            try:
                if dest.exists() or dest.is_symlink():
                    raise FileExistsError(f"{dest} exists")
                os.rename(sub, dest)
            except OSError as exc:
                stuck.append(f"{sub} -> {dest} ({exc.strerror or exc})")
                continue
            moved.append(name)
            log.info("event=store_layout_moved model=%s from=%s to=%s", name, sub, dest)
        with contextlib.suppress(OSError):
            org.rmdir()  # empty now (else it holds other files: left as it is)
    if stuck:
        raise StoreError(
            f"the weight store {root} holds models in the old ORG/NAME layout that could not be "
            f"moved to ORG{STORE_SEP}NAME: {'; '.join(stuck[:5])}; move them (in the store: mv "
            f"ORG/NAME ORG{STORE_SEP}NAME) or make the store writable once"
        )
    return moved
