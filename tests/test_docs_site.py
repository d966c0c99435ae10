"""The documentation site's link rewriting (hack/docs/hooks.py), without MkDocs: links written for
the repository become site links, or code spans for files that are not on the site. The strict
build itself runs in hack/test.sh (hack/docs/site.sh build)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "hack" / "docs" / "hooks.py")
assert _spec is not None and _spec.loader is not None
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)

# repository path -> site path, as on_page_markdown builds it
SITE = {
    "docs/images.md": "images.md",
    "docs/up.md": "up.md",
    "docs/up/example-report.md": "up/example-report.md",
    "docs/dashboard.png": "dashboard.png",
    "README.md": "overview.md",
    "helm/warmserve/README.md": "install/helm-chart.md",
}
REPO_FILES = {"helm/warmserve/values.yaml", "bench/sim_speed.py", "hack/k8s", "hack/test.sh"}


def _exists(path: str) -> bool:
    return path in REPO_FILES or path in SITE


def chart(md: str) -> str:
    page = "helm/warmserve/README.md"
    return hooks.rewrite_links(md, page, "install/helm-chart.md", SITE, _exists)


def docs(md: str, page: str = "images.md") -> str:
    return hooks.rewrite_links(md, f"docs/{page}", page, SITE, _exists)


def test_a_link_to_a_page_on_the_site_becomes_a_site_link() -> None:
    assert chart("see [images](../../docs/images.md).") == "see [images](../images.md)."
    assert (
        chart('[report](../../docs/up/example-report.md#summary "the report")')
        == '[report](../up/example-report.md#summary "the report")'
    )
    assert docs("[overview](../README.md#quickstart)") == "[overview](overview.md#quickstart)"
    assert docs("[chart](../../helm/warmserve/README.md)", "up/example-report.md") == (
        "[chart](../install/helm-chart.md)"
    )
    assert docs("![the dashboard](dashboard.png)", "dashboards.md") == (
        "![the dashboard](dashboard.png)"
    )


def test_a_link_that_already_works_is_left_as_written() -> None:
    for md in ("[up](up.md)", "[report](up/example-report.md#summary)", "[a](#anchor)"):
        assert docs(md) == md


def test_a_link_to_a_repository_file_off_the_site_becomes_its_path_in_a_code_span() -> None:
    assert chart("in [`values.yaml`](values.yaml);") == "in `helm/warmserve/values.yaml`;"
    assert docs("[bench/sim_speed.py](../bench/sim_speed.py)") == "`bench/sim_speed.py`"
    assert docs("the [speed benchmark](../bench/sim_speed.py#L10)") == (
        "the speed benchmark (`bench/sim_speed.py`)"
    )
    assert docs("[k8s](../hack/k8s/)") == "`hack/k8s/`"


def test_a_broken_link_is_left_for_the_strict_build_to_report() -> None:
    for md in (
        "[gone](../bench/no_such.py)",
        "[gone](nope.md)",
        "[outside](../../etc/passwd)",
        "![script](../hack/test.sh)",
    ):
        assert docs(md) == md


def test_external_absolute_and_mail_links_are_left_alone() -> None:
    for md in ("[kopf](https://kopf.readthedocs.io)", "[x](/abs.md)", "[m](mailto:a@b.c)"):
        assert docs(md) == md


def test_code_is_never_rewritten() -> None:
    md = (
        "`[x](../README.md)` and ``a `[y](../README.md)` b``\n"
        "```bash\n[z](../README.md)\n```\n"
        "~~~~\n```\n[w](../README.md)\n~~~~\n"
        "[v](../README.md)\n"
    )
    out = docs(md)
    assert out.splitlines()[:-1] == md.splitlines()[:-1]
    assert out.splitlines()[-1] == "[v](overview.md)"


def test_an_unclosed_fence_keeps_the_rest_as_code() -> None:
    md = "[a](../README.md)\n```\n[b](../README.md)\n"
    assert docs(md) == "[a](overview.md)\n```\n[b](../README.md)\n"


@given(st.text(alphabet=st.characters(blacklist_characters="[")))
def test_text_without_links_is_unchanged(md: str) -> None:
    assert docs(md) == md
    assert chart(md) == md


def test_repo_pages_must_map_site_paths_to_repository_paths() -> None:
    assert hooks.repo_pages({"extra": {"repo_pages": {"a.md": "A.md"}}}) == {"a.md": "A.md"}
    assert hooks.repo_pages({"extra": {}}) == {}
    with pytest.raises(ValueError, match="repo_pages"):
        hooks.repo_pages({"extra": {"repo_pages": ["README.md"]}})
    with pytest.raises(ValueError, match="repo_pages"):
        hooks.repo_pages({"extra": {"repo_pages": {"a.md": 1}}})
