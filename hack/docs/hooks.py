"""MkDocs hooks of warmserve's documentation site (mkdocs.yml `hooks:`).

1. Pages from outside docs/. The README, the Helm chart's README and a few more live beside what
   they describe, where GitHub shows them; `extra.repo_pages` in mkdocs.yml maps a site path to
   each, and the file is added to the site as it is.
2. Links are written for the repository: relative to the file's own folder, as GitHub resolves
   them. On the site, a link to a file that is on the site becomes a link to that page; a link to
   any other repository file (a script, `values.yaml`) becomes its repository path in a code span,
   the way the pages name files everywhere else: the project publishes no source browser to link
   to. A link to a path that does not exist is left alone, so `mkdocs build --strict` reports it.

Everything but `on_files` and `on_serve` is plain Python, tested without MkDocs
(tests/test_docs_site.py).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# An inline link or image, or an inline code span (left alone: `[a](b)` in code is not a link).
# The link text may hold code spans and one level of brackets; the target has no spaces and may
# have a title.
_TOKEN = re.compile(
    r"""(?P<link>(?P<bang>!?)\[(?P<text>(?:`[^`]*`|\[[^\]]*\]|[^\[\]`])*)\]
            \((?P<target>[^()\s]+)(?P<title>\s+"[^"]*")?\))
      | (?P<code>(?P<ticks>`+).+?(?P=ticks))""",
    re.VERBOSE | re.DOTALL,
)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def repo_root(config: Mapping[str, Any]) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def repo_pages(config: Mapping[str, Any]) -> dict[str, str]:
    """The site path -> repository path table of mkdocs.yml's `extra.repo_pages`."""
    table = (config.get("extra") or {}).get("repo_pages") or {}
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in table.items()
    ):
        raise ValueError("mkdocs.yml extra.repo_pages must map site paths to repository paths")
    return dict(table)


def rewrite_links(
    markdown: str,
    page_repo_path: str,
    page_site_path: str,
    site_paths: Mapping[str, str],
    exists: Callable[[str], bool],
) -> str:
    """The page's Markdown with its repository links made site links (see the module docstring).

    page_repo_path / page_site_path: the page's path in the repository and on the site (both
    relative, '/'-separated). site_paths: repository path -> site path of every file on the site.
    exists: whether a repository path (a file or a folder) exists.
    """
    here = posixpath.dirname(page_repo_path)
    site_here = posixpath.dirname(page_site_path)

    def link(m: re.Match[str]) -> str:
        if m.group("code") is not None:
            return m.group(0)
        target = m.group("target")
        if target.startswith(("#", "/")) or _SCHEME.match(target):
            return m.group(0)
        path, sep, fragment = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(here, path))
        if resolved == ".." or resolved.startswith("../"):
            return m.group(0)  # outside the repository: left for MkDocs to report
        if resolved in site_paths:
            new = posixpath.relpath(site_paths[resolved], site_here or ".")
            if new == path:
                return m.group(0)
            title = m.group("title") or ""
            return f"{m.group('bang')}[{m.group('text')}]({new}{sep}{fragment}{title})"
        if m.group("bang") or not exists(resolved):
            return m.group(0)
        shown = resolved + ("/" if path.endswith("/") else "")
        text = m.group("text")
        plain = text.strip().strip("`").rstrip("/")
        if plain in {resolved, posixpath.basename(resolved)}:
            return f"`{shown}`"
        return f"{text} (`{shown}`)"

    out: list[str] = []
    chunk: list[str] = []
    fence: str | None = None
    for line in markdown.splitlines(keepends=True):
        f = _FENCE.match(line)
        if fence is None and f:
            out.append(_TOKEN.sub(link, "".join(chunk)))
            chunk = []
            fence = f.group(1)
            out.append(line)
        elif fence is not None:
            out.append(line)
            if f and f.group(1)[0] == fence[0] and len(f.group(1)) >= len(fence):
                fence = None
        else:
            chunk.append(line)
    out.append(_TOKEN.sub(link, "".join(chunk)))
    return "".join(out)


# --- MkDocs event hooks -------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    root = repo_root(config)
    for site_path, repo_path in repo_pages(config).items():
        source = root / repo_path
        if not source.is_file():
            raise FileNotFoundError(f"mkdocs.yml extra.repo_pages: {repo_path} does not exist")
        if files.get_file_from_path(site_path) is not None:
            raise ValueError(f"mkdocs.yml extra.repo_pages: docs/{site_path} exists already")
        files.append(File.generated(config, site_path, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root = repo_root(config)
    docs = Path(config["docs_dir"]).resolve().relative_to(root).as_posix()
    mirrored = repo_pages(config)
    site_paths = {
        f"{docs}/{f.src_uri}": f.src_uri
        for f in files
        if f.src_uri not in mirrored and not f.inclusion.is_excluded()
    }
    site_paths.update({repo: site for site, repo in mirrored.items()})
    src = page.file.src_uri
    return rewrite_links(
        markdown,
        mirrored.get(src, f"{docs}/{src}"),
        src,
        site_paths,
        lambda p: (root / p).exists(),
    )


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    # `mkdocs serve` watches docs/ only; rebuild when a page from elsewhere changes too.
    root = repo_root(config)
    for folder in sorted({(root / p).parent for p in repo_pages(config).values()}):
        server.watch(str(folder), recursive=False)
    return server
