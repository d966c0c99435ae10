"""Weight store, slot layout and loader: byte-for-byte checks against real safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from warmserve_agent.backends.simulated import PhysicalReader, SimulatedBackend
from warmserve_agent.loader import load_layers, verify_layers
from warmserve_agent.memory import MemoryManager, pages_for
from warmserve_agent.store import StoreError, UnknownModel, WeightStore
from warmserve_agent.testing import write_model

P = 64 * 1024


def file_bytes(model_dir: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update({k: v.tobytes() for k, v in load_file(str(f)).items()})
    return out


def test_layers_of_tensors(model_root: Path) -> None:
    m = WeightStore(model_root).model("alpha")
    layer = {t.name: t.layer for t in m.tensors}
    assert layer["model.embed_tokens.weight"] == 0
    assert layer["model.layers.2.mlp.down_proj.weight"] == 2
    assert layer["model.norm.weight"] == 3 and layer["lm_head.weight"] == 3
    assert [t.layer for t in m.tensors] == sorted(t.layer for t in m.tensors)
    assert m.profile.max_batch == 4


def test_layout_prefixes(model_root: Path) -> None:
    store = WeightStore(model_root)
    lay = store.layout("alpha", 1)
    ends = [lay.bytes_for_layers(n) for n in range(5)]
    assert ends[0] == 0 and ends == sorted(ends) and ends[4] == lay.total_bytes
    assert lay.total_bytes >= store.model("alpha").weight_bytes
    lay2 = store.layout("alpha", 2)
    assert lay2.total_bytes < lay.total_bytes


@pytest.mark.parametrize("tp", [1, 2])
def test_loaded_bytes_equal_file_bytes(model_root: Path, tmp_path: Path, tp: int) -> None:
    store = WeightStore(model_root)
    lay = store.layout("alpha", tp)
    backend = SimulatedBackend(tmp_path / "g", page_bytes=P)
    mm = MemoryManager(backend)
    for g in range(tp):
        mm.add_gpu(g, 64 * P)
    mm.create_slot("s", range(tp))
    mm.promise("s", pages_for(lay.bytes_for_layers(2), P))
    seen: list[int] = []
    rep = load_layers(
        mm, store, "s", lay, list(range(tp)), 0, 2, on_layer=lambda n, b, s: seen.append(n)
    )
    assert seen == [1, 2] and rep.bytes_loaded > 0
    truth = file_bytes(model_root / "alpha")
    readers = [PhysicalReader(backend.path(g), P) for g in range(tp)]
    npages = mm.mapped_prefix("s", 0)
    checked = 0
    for pl in lay.placements:
        if pl.tensor.layer >= 2:
            continue
        shards = []
        for g in range(tp):
            _, n = pl.shard(g)
            ppages = mm.physical_pages("s", g, 0, npages)
            shards.append(readers[g].read(ppages, pl.slot_offset, n))
        assert b"".join(shards) == truth[pl.tensor.name], pl.tensor.name
        checked += 1
    assert checked == sum(1 for p in lay.placements if p.tensor.layer < 2)
    # Layers 2.. are not resident yet; load them later (the instance would already serve).
    load_layers(mm, store, "s", lay, list(range(tp)), 2, 4)
    digests = [store.digests(lay, r) for r in range(tp)]
    assert verify_layers(lambda r, o, n: mm.read("s", r, o, n), lay, digests, range(tp), 4) == []
    mm.write("s", 0, lay.placements[-1].slot_offset, b"\x00\x01corrupt")
    bad = verify_layers(lambda r, o, n: mm.read("s", r, o, n), lay, digests, range(tp), 4)
    assert bad == [f"{lay.placements[-1].tensor.name}[rank 0]"]
    for r in readers:
        r.close()
    mm.check()
    mm.close()


def test_store_errors(model_root: Path, tmp_path: Path) -> None:
    store = WeightStore(model_root)
    with pytest.raises(
        UnknownModel, match=r"unknown model 'nope'.*models here: alpha, beta, gamma"
    ):
        store.model("nope")
    with pytest.raises(StoreError, match="malformed model name"):
        store.model("../etc")
    bad = tmp_path / "bad"
    write_model(bad, "m", layers=2)
    (bad / "m" / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(StoreError, match="num_hidden_layers"):
        WeightStore(bad).model("m")
    (bad / "m" / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    with pytest.raises(StoreError, match=r"layer 1 but config\.json says num_hidden_layers=1"):
        WeightStore(bad).model("m")
