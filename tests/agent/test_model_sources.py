"""Model sources and the fetcher: names with '/', the URI grammar, hf:// through the real
huggingface_hub client against a local server speaking the Hub's file protocol
(tests/model_sources_support.py), pvc:// and file:// links, checksums, retries, coalescing, the
disk budget with LRU eviction, and progress."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import write_model
from warmserve_agent.sources import SourceError, SourceSettings, inspect, open_source
from warmserve_agent.sources.disk_reserve import DiskReserve
from warmserve_agent.sources.fetch_records import MANIFEST, FetchFailed, FetchState
from warmserve_agent.sources.fetcher import ModelFetcher
from warmserve_agent.store import StoreError, WeightStore

from tests.model_sources_support import HubServer, Repo, repo_from_dir
from warmserve.modelref import (
    MODEL_NAME_MAX,
    MODEL_NAME_PATTERN,
    SourceURIError,
    parse_source,
    store_dirname,
)

ROOT = Path(__file__).resolve().parents[2]
LONG = "o" * 100 + "/" + "m" * 99  # 200 characters, the CRD's maximum


def crd_model_schema() -> dict:
    doc = yaml.safe_load((ROOT / "crds" / "warmserve.io_modeldeployments.yaml").read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["model"]["properties"]


def test_model_name_rule_is_the_crds() -> None:
    name = crd_model_schema()["name"]
    assert name["pattern"] == MODEL_NAME_PATTERN
    assert name["maxLength"] == MODEL_NAME_MAX == len(LONG)


GOOD = [
    "hf://meta-llama/Llama-3.1-8B-Instruct",
    "hf://org/name@main",
    "hf://org/name@v1.0",
    "hf://org/name@release/2024-06",
    "hf://org/name@refs/heads/main",
    "hf://org/name@refs/tags/v1.0",
    "hf://org/name@0123456789abcdef0123456789abcdef01234567",
    "s3://models-bucket/llama/8b",
    "s3://my.bucket/x",
    "pvc://model-store",
    "pvc://model-store/llama/8b",
    "file:///var/lib/models/llama",
]
BAD = [
    "",
    "llama",
    "http://example/x",
    "hf://name-only",
    "hf://org/name@",
    "hf://org/name@refs/pr/12",  # pull-request refs: unmerged code anyone may push
    "hf://org/name@refs/convert/parquet",
    "hf://org/name@refs",
    "hf://org/name@refs/heads/",
    "hf://org/name@a..b",
    "hf://org/name@v1.lock",
    "hf://org/name@v1.",
    "hf://org/name@a//b",
    "hf://org/name@-x",
    "hf://org/name@.hidden",
    "hf://org/name@main\n",
    "hf://org/name@ma in",
    "hf://org/name@x~1",
    "hf://org/name@" + "a" * 256,
    "hf://org/name/extra",
    "hf://org/../x",
    "s3://bucket",
    "s3://bucket/",
    "s3://bucket/x/",
    "s3://Bucket/x",
    "s3://bucket//x",
    "s3://b/x",
    "pvc://Claim/x",
    "pvc://claim/../x",
    "pvc://claim/./x",
    "pvc://claim/",
    "file://relative",
    "file:///a/../b",
    "file:///a/",
    "gs://bucket/x",
]


@pytest.mark.parametrize("uri", GOOD)
def test_good_source_uris_parse(uri: str) -> None:
    ref = parse_source(uri)
    assert ref.scheme == uri.split("://")[0]


@pytest.mark.parametrize("uri", BAD)
def test_bad_source_uris_are_refused(uri: str) -> None:
    with pytest.raises(SourceURIError):
        parse_source(uri)


def test_store_lists_and_reads_names_with_a_slash_up_to_the_crd_length(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_model(root, store_dirname("meta-llama/Llama-3-8B"), layers=2, hidden=16)
    write_model(root, store_dirname(LONG), layers=2, hidden=16, seed=3)
    write_model(root, "plain", layers=2, hidden=16, seed=4)
    store = WeightStore(root)
    assert store.model_path("meta-llama/Llama-3-8B") == root / "meta-llama~Llama-3-8B"
    assert store.list_models() == sorted(["meta-llama/Llama-3-8B", LONG, "plain"])
    assert store.model("meta-llama/Llama-3-8B").num_layers == 2
    assert store.model(LONG).name == LONG
    for bad in ("../etc", "a/b/c", "o" * 201, "/abs", "a/.hidden"):
        with pytest.raises(StoreError, match="model name"):
            store.model(bad)


# ---- hf:// ------------------------------------------------------------------------------------
@pytest.fixture
def upstream(tmp_path: Path) -> dict[str, Repo]:
    src = tmp_path / "upstream"
    return {
        "org/alpha": repo_from_dir(write_model(src, "alpha", layers=3, hidden=64, seed=1)),
        "org/beta": repo_from_dir(write_model(src, "beta", layers=2, hidden=64, seed=2)),
        "org/gamma": repo_from_dir(write_model(src, "gamma", layers=2, hidden=64, seed=5)),
    }


def fetcher_for(
    store_root: Path, hub: HubServer | None = None, *, in_use=lambda: set(), **kw
) -> ModelFetcher:
    store_root.mkdir(parents=True, exist_ok=True)
    settings = kw.pop("settings", None) or SourceSettings(
        hf_endpoint=hub.url if hub else "", hf_token=kw.pop("token", ""), timeout_s=10
    )
    # No disk reserve unless a test sets one: the machine's free disk is not what it tests.
    kw.setdefault("reserve", DiskReserve(0.0, 0))
    return ModelFetcher(
        WeightStore(store_root),
        settings,
        lock=threading.RLock(),
        in_use=in_use,
        backoff_s=0.05,
        sample_s=0.1,
        **kw,
    )


def fetch(f: ModelFetcher, model: str, uri: str, timeout: float = 60) -> None:
    job = f.ensure(model, uri)
    assert job.wait(timeout), f"fetch of {model} did not finish"
    if job.error:
        raise job.error


def test_hf_fetch_fills_the_store_and_checks_every_file(tmp_path: Path, upstream) -> None:
    with HubServer(upstream) as hub:
        f = fetcher_for(tmp_path / "store", hub)
        fetch(f, "org/alpha", "hf://org/alpha")
        store = f.store
        assert store.list_models() == ["org/alpha"]
        m = store.model("org/alpha")
        assert m.num_layers == 3
        ref = WeightStore(tmp_path / "upstream").model("alpha")
        assert m.weight_bytes == ref.weight_bytes
        for t in ref.tensors:  # the bytes are the upstream bytes
            assert (store.model_path("org/alpha") / t.file.name).read_bytes() == t.file.read_bytes()
        manifest = json.loads((store.model_path("org/alpha") / MANIFEST).read_text())
        assert manifest["source"] == "hf://org/alpha"
        assert manifest["model"] == "org/alpha"
        assert manifest["revision"] == upstream["org/alpha"].commit
        assert all(x["sha256"] for x in manifest["files"] if x["path"].endswith(".safetensors"))
        assert all(x["git_sha1"] for x in manifest["files"] if x["path"] == "config.json")
        n = sum(hub.downloads.values())
        fetch(f, "org/alpha", "hf://org/alpha")  # present: nothing downloaded again
        assert sum(hub.downloads.values()) == n
        assert f.model_info("org/alpha")[0] == "hf://org/alpha"
        f.close()


def test_a_corrupted_download_is_refused_and_fetched_again(tmp_path: Path, upstream) -> None:
    shard = "model-00001-of-00002.safetensors"
    with HubServer(upstream) as hub:
        hub.corrupt[shard] = 1  # first download: one byte flipped, same size
        f = fetcher_for(tmp_path / "store", hub)
        fetch(f, "org/alpha", "hf://org/alpha")
        assert hub.downloads[shard] == 2
        assert f.stats["retries:checksum"] == 1
        good = (tmp_path / "upstream/alpha" / shard).read_bytes()
        assert (f.store.model_path("org/alpha") / shard).read_bytes() == good
        f.close()


def test_a_download_corrupted_every_time_fails_and_leaves_nothing(tmp_path: Path, upstream):
    shard = "model-00002-of-00002.safetensors"
    with HubServer(upstream) as hub:
        hub.corrupt[shard] = 99
        f = fetcher_for(tmp_path / "store", hub, attempts=2)
        with pytest.raises(
            FetchFailed,
            match=rf"after 2 attempts: {shard}: sha256 [0-9a-f]+, "
            "expected [0-9a-f]+",
        ) as exc:
            fetch(f, "org/alpha", "hf://org/alpha")
        assert exc.value.code == "UNAVAILABLE"
        assert hub.downloads[shard] == 2
        assert not f.store.has("org/alpha")
        # The good files stay staged for the next fetch to resume; the bad one was deleted.
        staged = tmp_path / "store/.warmserve-staging/org~alpha"
        assert (staged / "config.json").is_file() and not (staged / shard).exists()
        assert f.statuses()[0].state == FetchState.FAILED
        f.close()


def test_concurrent_requests_for_one_model_share_one_fetch(tmp_path: Path, upstream) -> None:
    with HubServer(upstream, rate=2e6) as hub:
        f = fetcher_for(tmp_path / "store", hub)
        jobs = [f.ensure("org/beta", "hf://org/beta") for _ in range(5)]
        assert all(j is jobs[0] for j in jobs)
        with pytest.raises(FetchFailed, match="being fetched from hf://org/beta"):
            f.ensure("org/beta", "hf://org/alpha")
        assert jobs[0].wait(60) and jobs[0].error is None
        assert all(n == 1 for n in hub.downloads.values()), hub.downloads
        f.close()


def test_progress_reports_bytes_rate_and_eta(tmp_path: Path) -> None:
    seen = []
    big = repo_from_dir(write_model(tmp_path / "up", "big", layers=2, hidden=512, seed=7))
    size = sum(len(v) for v in big.files.values())  # ~11 MB: 5-6 s at 2 MB/s
    with HubServer({"org/big": big}, rate=2e6) as hub:
        f = fetcher_for(tmp_path / "store", hub, parallel=1, on_change=seen.append)
        t0 = time.monotonic()
        fetch(f, "org/big", "hf://org/big")
        took = time.monotonic() - t0
        f.close()
    moving = [s for s in seen if s.state == FetchState.DOWNLOADING and 0 < s.bytes_done < size]
    assert [s.bytes_done for s in moving] == sorted(s.bytes_done for s in moving)
    timed = [s for s in moving if s.eta_s > 0]
    assert len(timed) >= 2, seen
    for s in timed:  # rate within 2x of the server's; ETA consistent with what was left
        assert 1e6 < s.bytes_per_s < 4e6, s
        assert s.eta_s == pytest.approx((size - s.bytes_done) / s.bytes_per_s)
        assert s.eta_s < took
    assert seen[-1].state == FetchState.DONE and seen[-1].bytes_done == size


def test_hf_token_revisions_and_missing_repos(tmp_path: Path, upstream) -> None:
    with HubServer(upstream, token="hf_secret") as hub:
        anon = fetcher_for(tmp_path / "a", hub)
        with pytest.raises(FetchFailed, match="repository not found, or private"):
            fetch(anon, "org/alpha", "hf://org/alpha")
        authed = fetcher_for(tmp_path / "b", hub, token="hf_secret")
        fetch(authed, "org/alpha", "hf://org/alpha@main")
        with pytest.raises(FetchFailed, match="revision not found") as exc:
            fetch(authed, "org/beta", "hf://org/beta@v9")
        assert exc.value.code == "FAILED_PRECONDITION"  # not retried: it will not appear
        with pytest.raises(FetchFailed, match="not found"):
            fetch(authed, "org/zeta", "hf://org/zeta")
        anon.close()
        authed.close()


def test_inspect_reads_layers_and_bytes_without_downloading(tmp_path: Path, upstream) -> None:
    with HubServer(upstream) as hub:
        f = fetcher_for(tmp_path / "store", hub)
        facts = f.inspect("org/alpha", "hf://org/alpha")
        assert sum(hub.downloads.values()) == 0  # ranges only
        ref = WeightStore(tmp_path / "upstream").model("alpha")
        assert (facts.num_layers, facts.weight_bytes, facts.num_tensors) == (
            3,
            ref.weight_bytes,
            len(ref.tensors),
        )
        assert facts.max_batch == 4
        f.close()


# ---- budget and LRU eviction ------------------------------------------------------------------
def model_bytes(repo: Repo) -> int:
    return sum(len(v) for v in repo.files.values())


def test_budget_evicts_the_least_recently_used_cold_model(tmp_path: Path, upstream) -> None:
    busy: set[str] = set()
    two = model_bytes(upstream["org/alpha"]) + model_bytes(upstream["org/beta"])
    with HubServer(upstream) as hub:
        f = fetcher_for(tmp_path / "store", hub, budget_bytes=two + 1000, in_use=lambda: busy)
        fetch(f, "org/alpha", "hf://org/alpha")
        time.sleep(0.05)
        fetch(f, "org/beta", "hf://org/beta")
        time.sleep(0.05)
        f.touch("org/alpha")  # alpha used after beta: beta is the coldest
        fetch(f, "org/gamma", "hf://org/gamma")
        assert f.store.list_models() == ["org/alpha", "org/gamma"]
        assert f.usage().evictions == 1
        assert f.usage().used_bytes <= f.budget_bytes
        # Everything in use: nothing can be evicted, the fetch says why.
        busy.update({"org/alpha", "org/gamma"})
        with pytest.raises(
            FetchFailed, match=r"no cold model can be evicted.*org/alpha, org/gamma"
        ):
            fetch(f, "org/beta", "hf://org/beta")
        assert f.store.list_models() == ["org/alpha", "org/gamma"]
        f.close()


def test_prefilled_models_count_but_are_never_evicted(tmp_path: Path, upstream) -> None:
    store = tmp_path / "store"
    write_model(store, "prefilled", layers=2, hidden=64, seed=9)
    pre = sum(p.stat().st_size for p in (store / "prefilled").iterdir())
    with HubServer(upstream) as hub:
        budget = pre + model_bytes(upstream["org/alpha"]) + 500
        f = fetcher_for(store, hub, budget_bytes=budget)
        fetch(f, "org/alpha", "hf://org/alpha")
        fetch(f, "org/beta", "hf://org/beta")  # room made by evicting alpha, not the pre-filled
        assert f.store.list_models() == ["org/beta", "prefilled"]
        f.close()
        tight = fetcher_for(store, hub, budget_bytes=pre + model_bytes(upstream["org/beta"]) + 10)
        with pytest.raises(FetchFailed, match="pre-filled models are never evicted") as exc:
            fetch(tight, "org/alpha", "hf://org/alpha")  # needs more than evicting beta frees
        assert exc.value.code == "RESOURCE_EXHAUSTED"
        assert tight.store.has("prefilled") and not tight.store.has("org/alpha")
        tight.close()


def test_a_pinned_model_is_not_evicted(tmp_path: Path, upstream) -> None:
    one = model_bytes(upstream["org/alpha"])
    with HubServer(upstream) as hub:
        f = fetcher_for(tmp_path / "store", hub, budget_bytes=one + 100)
        fetch(f, "org/alpha", "hf://org/alpha")
        with f.pinned("org/alpha"), pytest.raises(FetchFailed, match=r"evicted.*: org/alpha;"):
            fetch(f, "org/gamma", "hf://org/gamma")
        fetch(f, "org/gamma", "hf://org/gamma")  # unpinned: alpha goes
        assert f.store.list_models() == ["org/gamma"]
        f.close()


def test_leftovers_of_a_crashed_agent(tmp_path: Path, upstream) -> None:
    """Retired copies in the trash are removed at start; partial downloads stay until a fetch
    resumes them or needs their room."""
    store = tmp_path / "store"
    (store / ".warmserve-trash" / "old").mkdir(parents=True)
    (store / ".warmserve-trash" / "old" / "x.safetensors").write_bytes(b"x" * 100)
    (store / ".warmserve-staging" / "dead").mkdir(parents=True)
    (store / ".warmserve-staging" / "dead" / "x.safetensors").write_bytes(b"x" * 100)
    with HubServer(upstream) as hub:
        f = fetcher_for(store, hub)
        assert not (store / ".warmserve-trash").exists()
        assert (store / ".warmserve-staging" / "dead").exists()
        assert f.store.list_models() == []
        assert f.usage().used_bytes == 100  # partial downloads count against the budget
        f.budget_bytes = model_bytes(upstream["org/alpha"]) + 50
        fetch(f, "org/alpha", "hf://org/alpha")  # needs the room: the stale partial goes
        assert not (store / ".warmserve-staging" / "dead").exists()
        f.close()


# ---- in-place sources -------------------------------------------------------------------------
def test_pvc_and_file_sources_are_linked_in_place(tmp_path: Path) -> None:
    pvc_root = tmp_path / "pvc"
    write_model(pvc_root / "models-claim" / "llama", "8b", layers=2, hidden=32)
    node = tmp_path / "node-models"
    write_model(node, "mistral", layers=2, hidden=32, seed=2)
    settings = SourceSettings(pvc_root=pvc_root, allowed_paths=(node,))
    f = fetcher_for(tmp_path / "store", settings=settings)
    fetch(f, "org/llama", "pvc://models-claim/llama/8b")
    fetch(f, "mistral", f"file://{node}/mistral")
    link = f.store.model_path("org/llama")
    assert link == tmp_path / "store/org~llama"
    assert link.is_symlink() and Path(os.path.realpath(link)) == pvc_root / "models-claim/llama/8b"
    assert f.store.model("org/llama").num_layers == 2
    assert f.usage().used_bytes == 0  # links use no budget
    # Same source again: nothing to do; another source: relinked.
    fetch(f, "org/llama", "pvc://models-claim/llama/8b")
    write_model(pvc_root / "models-claim" / "llama", "70b", layers=3, hidden=32)
    fetch(f, "org/llama", "pvc://models-claim/llama/70b")
    assert f.store.model("org/llama").num_layers == 3
    with pytest.raises(FetchFailed, match="not mounted in this agent"):
        fetch(f, "x", "pvc://other-claim/x")
    with pytest.raises(FetchFailed, match="not under an allowed node path"):
        fetch(f, "x", f"file://{tmp_path}/elsewhere")
    f.close()


def test_in_place_sources_cannot_escape_through_symlinks(tmp_path: Path) -> None:
    pvc_root = tmp_path / "pvc"
    (pvc_root / "claim").mkdir(parents=True)
    secret = tmp_path / "secret"
    write_model(tmp_path, "secret", layers=1, hidden=8)
    (pvc_root / "claim" / "evil").symlink_to(secret)
    src_settings = SourceSettings(pvc_root=pvc_root)
    with pytest.raises(SourceError, match="outside"):
        open_source("pvc://claim/evil", src_settings)


def test_a_directory_without_weights_is_not_a_model(tmp_path: Path) -> None:
    node = tmp_path / "node"
    (node / "empty").mkdir(parents=True)
    (node / "empty" / "config.json").write_text('{"num_hidden_layers": 2}')
    settings = SourceSettings(allowed_paths=(node,))
    with pytest.raises(SourceError, match=r"no \*\.safetensors"):
        inspect(open_source(f"file://{node}/empty", settings))
