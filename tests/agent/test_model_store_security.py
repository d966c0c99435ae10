"""The weight store cannot be used to delete, overwrite or read into another model's files.

With the real fetcher and store on real directories, the real ``huggingface_hub`` client against
the local Hub-protocol server (tests/model_sources_support.py): a one-part model name never
touches the ``ORG/NAME`` models that share its first part; listed paths that would leave the
staging directory are refused and no write follows a link; links inside ``pvc://``/``file://``
models stay inside them; revisions are branches, tags or commits; a download cut off midway is
resumed by the next fetch; fetches keep a disk reserve free.  S3 keys (``//``) are tested
against the real S3 server in test_model_source_s3.py.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import hypothesis.strategies as st
import pytest
from conftest import write_model
from hypothesis import HealthCheck, given, settings
from warmserve_agent.sources import SourceError, SourceSettings, open_source
from warmserve_agent.sources.base import RemoteFile, select
from warmserve_agent.sources.disk_reserve import DEFAULT_RESERVE, DiskReserve
from warmserve_agent.sources.fetch_records import FetchFailed
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.sources.hf import HfSource
from warmserve_agent.store import StoreError, WeightStore

from tests.model_sources_support import HubServer, Repo, repo_from_dir
from warmserve.modelref import MODEL_NAME_MAX, MODEL_NAME_PATTERN, HfRef
from warmserve.units import SizeError

# What this change added is imported where it is used, so that every behavioural test here also
# runs (and fails for the right reason) against the code before it.

GiB = 1024**3


def fetcher(root: Path, hub: HubServer | None = None, **kw) -> ModelFetcher:
    root.mkdir(parents=True, exist_ok=True)
    settings = kw.pop("settings", None) or SourceSettings(
        hf_endpoint=hub.url if hub else "", timeout_s=10
    )
    # No disk reserve unless a test sets one: the machine's free disk is not what it tests.
    kw.setdefault("reserve", DiskReserve(0.0, 0))
    kw.setdefault("in_use", lambda: set())
    return ModelFetcher(
        WeightStore(root),
        settings,
        lock=threading.RLock(),
        backoff_s=0.05,
        sample_s=0.1,
        **kw,
    )


def fetch(f: ModelFetcher, model: str, uri: str) -> None:
    job = f.ensure(model, uri)
    assert job.wait(60), f"fetch of {model} did not finish"
    if job.error:
        raise job.error


def digests(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def repos(tmp_path: Path) -> dict[str, Repo]:
    up = tmp_path / "upstream"
    return {
        "meta-llama/Llama-3-8B": repo_from_dir(write_model(up, "l8", layers=2, hidden=32, seed=1)),
        "acme/one": repo_from_dir(write_model(up, "one", layers=2, hidden=32, seed=2)),
        "acme/two": repo_from_dir(write_model(up, "two", layers=3, hidden=32, seed=3)),
    }


# ---- H2: names never nest ---------------------------------------------------------------------
def test_a_one_part_name_never_touches_the_models_under_its_org(tmp_path: Path, repos) -> None:
    """A deployment whose model is named ``meta-llama`` used to be stored at the directory that
    holds every ``meta-llama/...`` model, and fetching or retiring it removed them all."""
    org_model = "meta-llama/Llama-3-8B"
    with HubServer(repos) as hub:
        f = fetcher(tmp_path / "store", hub, in_use=lambda: {org_model})
        fetch(f, org_model, "hf://meta-llama/Llama-3-8B")
        kept = f.store.model_path(org_model)
        before = digests(kept)
        fetch(f, "meta-llama", "hf://acme/one")  # installs the one-part name
        assert digests(kept) == before
        fetch(f, "meta-llama", "hf://acme/two")  # another source: its old copy is retired
        assert digests(kept) == before
        assert f.store.model("meta-llama").num_layers == 3
        # Evicting the one-part model (the budget leaves room for one more model only).
        f.budget_bytes = f.usage().used_bytes + 10
        fetch(f, "acme/one", "hf://acme/one")
        assert f.usage().evictions == 1
        assert not f.store.has("meta-llama")
        assert digests(kept) == before
        assert f.store.list_models() == ["acme/one", org_model]
        assert sorted(p.name for p in (tmp_path / "store").iterdir() if p.name[0] != ".") == [
            "acme~one",
            "meta-llama~Llama-3-8B",
        ]
        f.close()


def test_a_directory_in_a_models_place_that_is_no_model_is_not_removed(
    tmp_path: Path, repos
) -> None:
    store = tmp_path / "store"
    stray = store / "acme~one"
    (stray / "data").mkdir(parents=True)
    (stray / "data" / "keep.txt").write_text("not a model")
    with HubServer(repos) as hub:
        f = fetcher(store, hub)
        with pytest.raises(FetchFailed, match="is not a model directory") as exc:
            fetch(f, "acme/one", "hf://acme/one")
        assert exc.value.code == "FAILED_PRECONDITION"
        assert (stray / "data" / "keep.txt").read_text() == "not a model"
        f.close()


_NAMES = st.from_regex(MODEL_NAME_PATTERN, fullmatch=True).filter(
    lambda n: len(n) <= MODEL_NAME_MAX
)


@settings(max_examples=300, deadline=None)
@given(a=_NAMES, b=_NAMES)
def test_store_paths_never_nest_and_stay_under_the_root(a: str, b: str) -> None:
    from warmserve.modelref import model_of_store_entry

    store = WeightStore(Path("/srv/models"))
    pa, pb = store.model_path(a), store.model_path(b)
    for name, p in ((a, pa), (b, pb)):
        assert p.parent == store.root  # one entry directly under the root
        assert os.path.normpath(p) == str(p)  # nothing to normalise: no '..', '.', '//'
        assert model_of_store_entry(p.name) == name  # reversible
        assert not p.name.startswith(".")  # never the store's own files
    if a != b:
        assert pa != pb
        assert not pb.is_relative_to(pa) and not pa.is_relative_to(pb)


@settings(max_examples=300, deadline=None)
@given(
    name=st.one_of(
        st.text(max_size=220),
        st.text(alphabet=st.sampled_from("ab0/.-_~\\\0\n"), max_size=12),
    )
)
def test_any_text_as_a_model_name_is_refused_or_one_entry_under_the_root(name: str) -> None:
    store = WeightStore(Path("/srv/models"))
    try:
        p = store.model_path(name)
    except StoreError:
        return
    assert p.parent == store.root and os.path.normpath(p) == str(p)
    assert p.name not in ("", ".", "..")


def test_an_old_nested_store_is_moved_to_the_flat_layout(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_model(root / "meta-llama", "Llama-3-8B", layers=2, hidden=16)
    write_model(root, "plain", layers=2, hidden=16, seed=2)
    before = digests(root / "meta-llama" / "Llama-3-8B")
    store = WeightStore(root)
    assert store.upgrade_layout() == ["meta-llama/Llama-3-8B"]
    assert not (root / "meta-llama").exists()
    assert digests(store.model_path("meta-llama/Llama-3-8B")) == before
    assert store.list_models() == ["meta-llama/Llama-3-8B", "plain"]
    assert store.upgrade_layout() == []  # idempotent


def test_a_name_in_both_layouts_stops_the_upgrade_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_model(root / "acme", "chat", layers=2, hidden=16)
    write_model(root, "acme~chat", layers=2, hidden=16, seed=2)
    with pytest.raises(StoreError, match=r"old ORG/NAME layout.*acme/chat.*mv ORG/NAME ORG~NAME"):
        WeightStore(root).upgrade_layout()
    assert (root / "acme" / "chat" / "config.json").is_file()  # nothing lost


# ---- H3 (all sources): listed paths never leave staging, writes never follow links ----------
@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/etc/passwd.json", "absolute"),
        ("a//b.json", "empty segment"),
        ("a/", "empty segment"),
        ("", "empty"),
        ("../x.json", r"'\.' or '\.\.' segment"),
        ("a/./b.json", r"'\.' or '\.\.' segment"),
        ("a\\..\\b.json", "backslash"),
        ("a\0.json", "NUL"),
        ("a\n.json", "control character"),
    ],
)
def test_unsafe_listed_paths_are_refused_by_name(path: str, why: str) -> None:
    from warmserve_agent.sources.base import check_remote_path

    with pytest.raises(SourceError, match=why):
        check_remote_path(path, "hf://org/x")
    files = [
        RemoteFile("config.json", 2),
        RemoteFile("model.safetensors", 8),
        RemoteFile(path, 1),
    ]
    with pytest.raises(SourceError, match="listed file"):
        select(files, "hf://org/x")  # the whole listing, even a file that is not fetched


def test_a_hub_listing_an_absolute_path_is_refused(tmp_path: Path, repos) -> None:
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    evil = Repo({**repos["acme/one"].files, str(victim): b'{"pwned": 1}'})
    with HubServer({"acme/evil": evil}) as hub:
        f = fetcher(tmp_path / "store", hub)
        with pytest.raises(FetchFailed, match=r"listed file '/.*victim\.json' is refused"):
            fetch(f, "evil", "hf://acme/evil")
        f.close()
    assert victim.read_text() == "{}"


def test_writes_never_follow_a_link_in_the_staging_directory(tmp_path: Path) -> None:
    from warmserve_agent.sources.fetch_staging import open_staged

    staging = tmp_path / "staging"
    staging.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("original")
    (staging / "sub").symlink_to(outside)  # as if raced in by someone
    (staging / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(SourceError, match="not a plain directory"):
        open_staged(staging, "sub/x.json")
    with pytest.raises(SourceError, match=r"refusing to write 'config\.json'"):
        open_staged(staging, "config.json")
    assert (outside / "config.json").read_text() == "original"
    assert not (outside / "x.json").exists()
    out, have = open_staged(staging, "deep/er/model.safetensors")
    with out:
        out.write(b"abc")
    assert have == 0 and (staging / "deep/er/model.safetensors").read_bytes() == b"abc"
    out, have = open_staged(staging, "deep/er/model.safetensors")  # resumed at its end
    with out:
        out.write(b"def")
    assert have == 3 and (staging / "deep/er/model.safetensors").read_bytes() == b"abcdef"


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(key=st.text(alphabet=st.sampled_from("ab./\\\0-_~\n"), max_size=12))
def test_any_listed_key_is_refused_or_written_inside_staging(tmp_path: Path, key: str) -> None:
    from warmserve_agent.sources.fetch_staging import open_staged

    staging = tmp_path / "st"
    staging.mkdir(exist_ok=True)
    try:
        out, _ = open_staged(staging, key)
    except SourceError:
        return
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        return  # clashes with an earlier example's file or directory: still inside
    out.close()
    target = Path(os.path.normpath(staging / key))
    assert str(target) == str(staging / key)  # nothing to normalise
    assert target.is_relative_to(staging) and target != staging
    assert target.is_file() and not target.is_symlink()


# ---- symlinks in pvc:// and file:// models ----------------------------------------------------
def _link_model(root: Path, name: str) -> tuple[Path, Path]:
    d = write_model(root, name, layers=2, hidden=32)
    shard = next(d.glob("*.safetensors"))
    return d, shard


@pytest.mark.parametrize("scheme", ["pvc", "file"])
def test_links_out_of_an_in_place_model_are_refused(tmp_path: Path, scheme: str) -> None:
    base = tmp_path / "pvc" / "claim" if scheme == "pvc" else tmp_path / "node"
    d, _ = _link_model(base, "llama")
    secret = tmp_path / "agent.key"
    secret.write_bytes(b"-----BEGIN PRIVATE KEY-----")
    _, other_shard = _link_model(base, "other-tenant")
    settings = SourceSettings(pvc_root=tmp_path / "pvc", allowed_paths=(tmp_path / "node",))
    uri = "pvc://claim/llama" if scheme == "pvc" else f"file://{base}/llama"
    f = fetcher(tmp_path / "store", settings=settings)
    for link, target in (
        (d / "tokenizer.json", secret),  # the agent's key
        (d / "extra.safetensors", other_shard),  # another model on the same volume
        (d / "etc", Path("/etc")),  # a directory
    ):
        link.symlink_to(target)
        with pytest.raises(FetchFailed, match=rf"{link.name} links to .*outside the model's dir"):
            fetch(f, "llama", uri)
        link.unlink()
    assert not f.store.has("llama")
    # A link that stays inside the model is allowed (and read through).
    (d / "sub").mkdir()
    os.rename(d / "config.json", d / "sub" / "config.json")
    (d / "config.json").symlink_to(d / "sub" / "config.json")
    fetch(f, "llama", uri)
    assert f.store.model("llama").num_layers == 2
    f.close()


def test_the_store_refuses_a_model_file_that_links_out(tmp_path: Path) -> None:
    root = tmp_path / "models"
    d = write_model(root, "m", layers=2, hidden=16)
    secret = tmp_path / "secret.safetensors"
    shard = next(d.glob("*.safetensors"))
    secret.write_bytes(shard.read_bytes())
    store = WeightStore(root)
    entry = store.model("m")
    t = entry.tensors[0]
    # Swapped for a link after the scan (a tenant who can write the volume): the read refuses.
    os.unlink(t.file)
    t.file.symlink_to(secret)
    with pytest.raises(StoreError, match="outside its model's directory"):
        store.host_view(t)
    store.forget("m")
    with pytest.raises(StoreError, match="outside its model's directory"):
        store.model("m")


# ---- revisions --------------------------------------------------------------------------------
def test_the_agent_refuses_a_pull_request_revision_and_a_non_commit_answer(
    tmp_path: Path, repos
) -> None:
    with pytest.raises(SourceError, match="refs/pr/1"):
        HfSource(HfRef("acme/one", "refs/pr/1"), SourceSettings(), "hf://acme/one@refs/pr/1")
    with pytest.raises(SourceError, match="not a branch, tag or commit"):
        open_source("hf://acme/one@refs/pr/1", SourceSettings())
    odd = Repo(dict(repos["acme/one"].files), commit="not-a-commit")
    with HubServer({"acme/odd": odd}) as hub:
        f = fetcher(tmp_path / "store", hub)
        with pytest.raises(FetchFailed, match="did not say which commit"):
            fetch(f, "odd", "hf://acme/odd")
        f.close()


# ---- resume -----------------------------------------------------------------------------------
def test_a_download_cut_midway_is_resumed_by_the_next_fetch(tmp_path: Path) -> None:
    big = repo_from_dir(write_model(tmp_path / "up", "big", layers=2, hidden=700, files=1))
    shard = "model-00001-of-00001.safetensors"
    size = len(big.files[shard])
    half = size // 2
    store = tmp_path / "store"
    with HubServer({"acme/big": big}) as hub:
        hub.cut_after[shard] = half  # the connection drops at half the file
        hub.unavailable[shard] = 10  # and the hub is down for a while after
        first = fetcher(store, hub, attempts=1)
        with pytest.raises(FetchFailed, match="503") as exc:
            fetch(first, "acme/big", "hf://acme/big")
        assert exc.value.code == "UNAVAILABLE"
        first.close()
        assert hub.served[shard] == half
        staged = store / ".warmserve-staging" / "acme~big" / shard
        kept = staged.stat().st_size  # what reached the disk (the client writes 1 MiB chunks)
        assert half - 1024**2 <= kept <= half
        # The hub is back; an agent restarted meanwhile fetches again and gets only the rest.
        hub.unavailable.clear()
        hub.served.clear()
        hub.ranges.clear()
        second = fetcher(store, hub)
        fetch(second, "acme/big", "hf://acme/big")
        assert hub.ranges[shard] == [kept]
        assert sum(hub.served.values()) == size - kept, hub.served
        got = second.store.model_path("acme/big") / shard
        assert got.read_bytes() == big.files[shard]  # and checked whole (sha256)
        assert not (store / ".warmserve-staging" / "acme~big").exists()
        second.close()


# ---- disk reserve -----------------------------------------------------------------------------
def test_reserve_forms_and_the_default() -> None:
    from warmserve_agent.sources.disk_reserve import DEFAULT_RESERVE, DiskReserve, parse_reserve

    assert parse_reserve("") == DEFAULT_RESERVE == DiskReserve(0.15, 10 * GiB)
    assert DEFAULT_RESERVE.bytes_for(40 * GiB) == 10 * GiB  # small disk: the floor
    assert DEFAULT_RESERVE.bytes_for(1000 * GiB) == 150 * GiB
    assert parse_reserve("20%").bytes_for(100 * GiB) == 20 * GiB
    assert parse_reserve("50GiB").bytes_for(1000 * GiB) == 50 * GiB
    assert parse_reserve("0").bytes_for(1000 * GiB) == 0
    for bad in ("lots", "100%", "-1GiB"):
        with pytest.raises(SizeError):
            parse_reserve(bad)


class FakeDisk:
    """statvfs of a disk whose free space the test sets (``free`` per call, last one repeats)."""

    def __init__(self, total: int, *free: int) -> None:
        self.total = total
        self.free = list(free)
        self.calls = 0

    def __call__(self, path: Path) -> object:
        from warmserve_agent.sources.disk_reserve import DiskSpace

        self.calls += 1
        n = self.free[0] if len(self.free) == 1 else self.free.pop(0)
        return DiskSpace(self.total, n)


def test_the_default_reserve_refuses_a_fetch_with_the_numbers(tmp_path: Path, repos) -> None:
    need = sum(len(v) for v in repos["acme/one"].files.values())
    with HubServer(repos) as hub:
        # 100 GiB disk: the default keeps 15 GiB; 15 GiB + need - 1 byte free is too little.
        disk = FakeDisk(100 * GiB, 15 * GiB + need - 1)
        f = fetcher(tmp_path / "store", hub, disk_space=disk, reserve=DEFAULT_RESERVE)
        with pytest.raises(FetchFailed) as exc:
            fetch(f, "acme/one", "hf://acme/one")
        assert exc.value.code == "RESOURCE_EXHAUSTED"
        msg = exc.value.message
        assert "15.0GiB reserve (the larger of 15% of 100.0GiB and 10.0GiB)" in msg, msg
        assert "--store-reserve" in msg and "usable" in msg
        assert sum(hub.downloads.values()) == 0  # refused before any download
        disk.free = [15 * GiB + need + 4096]
        fetch(f, "acme/one", "hf://acme/one")  # enough: fetched
        f.close()


def test_the_reserve_is_watched_while_downloading(tmp_path: Path, repos) -> None:
    with HubServer(repos) as hub:
        # Room when the fetch starts; then another writer fills the disk.
        disk = FakeDisk(100 * GiB, 50 * GiB, 15 * GiB)
        f = fetcher(tmp_path / "store", hub, disk_space=disk, parallel=1, reserve=DEFAULT_RESERVE)
        with pytest.raises(FetchFailed, match="while downloading") as exc:
            fetch(f, "acme/one", "hf://acme/one")
        assert exc.value.code == "RESOURCE_EXHAUSTED"
        assert not f.store.has("acme/one")
        f.close()


def test_a_reserve_above_the_real_free_space_refuses_the_fetch(tmp_path: Path, repos) -> None:
    from warmserve_agent.sources.disk_reserve import DiskReserve, disk_space

    store = tmp_path / "store"
    store.mkdir()
    free = disk_space(store).free
    with HubServer(repos) as hub:
        f = fetcher(store, hub, reserve=DiskReserve(0.0, free + GiB))
        with pytest.raises(FetchFailed, match=r"reserve \(--store-reserve\)") as exc:
            fetch(f, "acme/one", "hf://acme/one")
        assert exc.value.code == "RESOURCE_EXHAUSTED"
        assert sum(hub.downloads.values()) == 0
        assert not f.store.has("acme/one")
        f.close()
