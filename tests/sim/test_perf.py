"""Tests for warmserve.sim.hardware (profiles) and warmserve.sim.perf (physics).

Hand calculations are written out next to each expectation so a reader can redo them.
"""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from warmserve.policy.cluster import PolicyInputError
from warmserve.sim.hardware import (
    PROFILE_DIR,
    GpuProfile,
    ProfileError,
    list_profiles,
    load_profile,
    parse_profile,
)
from warmserve.sim.model_arch import EngineInputError, ModelArch, known_archs
from warmserve.sim.perf import EngineModel

H800 = load_profile("h800")
A100 = load_profile("a100-80g")
L7 = ModelArch.llama2("7b")
L13 = ModelArch.llama2("13b")
L70 = ModelArch.llama2("70b")


def _raw(name: str = "h800") -> dict:
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


# --------------------------------------------------------------------------- profiles


def test_bundled_profiles_load_and_are_cited():
    assert {"h800", "h100-sxm", "a100-80g"} <= set(list_profiles())
    for name in list_profiles():
        p = load_profile(name)
        assert isinstance(p, GpuProfile) and p.name == name
        assert p.usable_bytes > 60 * 2**30
        assert all(p.sources[k] for k in ("hbm_bw", "bf16_flops", "host_to_gpu_bw"))


def test_h800_matches_the_paper_testbed():
    # §7.1: "around 2K TFLOPS for FP16" is the sparse figure; dense is half.
    assert H800.nominal["fp16_sparse_flops"] == pytest.approx(2 * H800.bf16_flops, rel=1e-3)
    assert H800.nominal["nvlink_bw_bidirectional"] == 400e9
    assert H800.nominal["pcie_gen5_x16_bw_bidirectional"] == 128e9
    # effective rates are below the one-direction line rates
    assert H800.host_to_gpu_bw < 64e9
    assert H800.gpu_to_gpu_bw < 200e9
    assert H800.hbm_bw == 3.35e12


def test_profile_names_are_case_insensitive():
    assert load_profile("H800") == H800


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ProfileError, match=r"unknown GPU profile 'b300'.*h800"):
        load_profile("b300")
    with pytest.raises(PolicyInputError):  # the CLI maps this to exit status 2
        load_profile("")


def test_profile_from_path(tmp_path):
    path = tmp_path / "mine.yaml"
    raw = _raw()
    raw["name"] = "mine"
    path.write_text(yaml.safe_dump(raw))
    assert load_profile(str(path)).name == "mine"
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(bad))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("hbm_bw"), r"missing field\(s\) \['hbm_bw'\]"),
        (lambda d: d.update(hbm_bww=1), r"unknown field\(s\) \['hbm_bww'\]"),
        (lambda d: d.update(hbm_bw="fast"), "hbm_bw: expected a number"),
        (lambda d: d.update(hbm_bw=-1), "hbm_bw: must be > 0"),
        (lambda d: d.update(decode_efficiency=1.5), r"decode_efficiency: must be in \(0, 1\]"),
        (lambda d: d.update(hbm_bytes=1.5), "hbm_bytes: must be a whole number"),
        (lambda d: d.update(runtime_reserve_bytes=10**12), "leaves no usable memory"),
        (lambda d: d["startup"].pop("import_s"), r"startup: missing stage\(s\) \['import_s'\]"),
        (lambda d: d["startup"].update(warmup_s=1), "startup: unknown stage"),
        (lambda d: d["startup"].update(import_s=-2), "startup.import_s: must be >= 0"),
        (lambda d: d["sources"].pop("hbm_bw"), r"no citation for \['hbm_bw'\]"),
        (lambda d: d["sources"].pop("startup.comm_group_s"), "startup.comm_group_s"),
        (lambda d: d.update(sources="datasheet"), "sources: expected a mapping"),
    ],
)
def test_profile_validation_names_the_field(mutate, message):
    raw = _raw()
    mutate(raw)
    with pytest.raises(ProfileError, match=message):
        parse_profile(raw, "x.yaml")


def test_profile_top_level_must_be_mapping():
    with pytest.raises(ProfileError, match="top level"):
        parse_profile(["a"], "x.yaml")


# --------------------------------------------------------------------------- shapes


def test_llama2_parameter_counts_match_published_checkpoints():
    # meta-llama/Llama-2-*-hf parameter counts (exact integer sums of the safetensors shapes).
    assert L7.params == 6_738_415_616
    assert L13.params == 13_015_864_320
    assert L70.params == 68_976_648_192
    assert L7.weight_bytes == 2 * L7.params
    # KV bytes/token = 2 (K,V) x layers x kv_heads x head_dim x 2 B
    assert L7.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert L13.kv_bytes_per_token == 2 * 40 * 40 * 128 * 2
    assert L70.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # GQA, 8 KV heads


def test_named_and_generic_arches():
    assert ModelArch.named("llama2-70b") == L70
    assert known_archs() == ["llama2-7b", "llama2-13b", "llama2-70b"]
    with pytest.raises(EngineInputError, match="unknown model architecture 'gpt5'"):
        ModelArch.named("gpt5")
    with pytest.raises(EngineInputError, match="unknown Llama 2 size"):
        ModelArch.llama2("8b")
    g = ModelArch.generic("my-7b", 6.74e9, 32)
    assert g.params == 6_740_000_000 and g.num_layers == 32
    assert g.hidden == 4096  # 12 L h^2 + 2 V h = P  ->  h ~ 4.1e3, rounded to 128
    assert ModelArch.generic("tiny", 1.2e8, 12).hidden % 128 == 0
    with pytest.raises(EngineInputError, match="params must be > 0"):
        ModelArch.generic("x", 0, 4)
    assert L7.with_weight_bytes(10**10).weight_bytes == 10**10


def test_arch_validation():
    with pytest.raises(EngineInputError, match="num_layers must be >= 1"):
        ModelArch("m", 10**9, 0, 1024, 8, 128, 2 * 10**9, 1000)
    with pytest.raises(EngineInputError, match="not a multiple of num_kv_heads"):
        ModelArch("m", 10**9, 8, 1024, 3, 128, 2 * 10**9, 1000)


# --------------------------------------------------------------------------- engine physics


def test_decode_step_llama7b_batch1_hand_calculation():
    # Weight-streaming bound: every block + the LM head read once (the embedding is a lookup):
    # (params - vocab*hidden) * 2 B = 13.21 GB over 3.35 TB/s x 0.55 = 7.17 ms, plus the 1 ms
    # fixed cost of a forward pass.
    e = EngineModel(H800, L7, 1)
    hand = (L7.params - 32000 * 4096) * 2 / (3.35e12 * 0.55) + 1e-3
    assert e.decode_step_s(1, 0) == pytest.approx(hand, rel=1e-9)
    assert e.decode_step_s(1, 0) == pytest.approx(8.17e-3, rel=0.01)
    # 32 sequences x 1000 context tokens add 32000 x 0.5 MiB = 16.8 GB of KV reads
    hand32 = ((L7.params - 32000 * 4096) * 2 + 32_000 * 524_288) / (3.35e12 * 0.55) + 1e-3
    assert e.decode_step_s(32, 32_000) == pytest.approx(hand32, rel=1e-6)


NEMO_7B = {  # NeMo Framework Llama-2-7B, 128 in / 20 out, average latency in ms: (tp, batch)
    "h100-sxm": {
        (1, 1): 153.8,
        (1, 8): 199.2,
        (2, 1): 128.6,
        (2, 8): 156.2,
        (4, 1): 107.4,
        (4, 8): 134.6,
        (8, 1): 97.6,
        (8, 8): 129.1,
    },
    "a100-80g": {
        (1, 1): 234.0,
        (1, 8): 329.5,
        (2, 1): 171.7,
        (2, 8): 237.6,
        (4, 1): 143.7,
        (4, 8): 196.4,
        (8, 1): 136.5,
        (8, 8): 181.9,
    },
}


@pytest.mark.parametrize("name", sorted(NEMO_7B))
def test_request_latency_against_nemo_measurements(name):
    # decode_efficiency, step_overhead_s and allreduce_latency_s were derived from these rows
    # (see the profiles' sources), so this is a consistency check of the whole model: one
    # prefill of batch x 128 tokens and 19 decode steps must land within 25 % of each row.
    prof = load_profile(name)
    for (tp, batch), ms in NEMO_7B[name].items():
        e = EngineModel(prof, L7, tp)
        model = e.prefill_batch_s(batch, 128) + sum(
            e.decode_step_s(batch, batch * (128 + i)) for i in range(1, 20)
        )
        assert model * 1e3 == pytest.approx(ms, rel=0.25), (tp, batch)


def test_prefill_llama7b_hand_calculation():
    # Compute-bound: per block 2 x 202.38M params x 1000 tok + causal attention 2 x 1000^2 x 4096
    # = 4.130e11 FLOP over 989.4 TFLOPS x 0.5 -> 0.835 ms; x32 = 26.7 ms, + LM head read 0.14 ms
    # + 1 ms per forward pass.
    e = EngineModel(H800, L7, 1)
    block = (2 * L7.layer_params * 1000 + 2 * 1000**2 * 4096) / (989.4e12 * 0.5)
    head = 32000 * 4096 * 2 / (3.35e12 * 0.55) + 1e-3
    assert e.prefill_s(1000) == pytest.approx(32 * block + head, rel=1e-9)
    assert e.prefill_s(1000) == pytest.approx(27.86e-3, rel=0.01)
    # two prompts in one pass cost the GEMMs of 2000 tokens but attention of 2 x 1000^2
    assert e.prefill_s([1000, 1000]) < e.prefill_s(2000)


def test_tensor_parallel_adds_allreduce_and_splits_work():
    e1 = EngineModel(H800, L70, 4)
    # ring all-reduce of 1 token: 2*(3/4)*8192*2 B / 160 GB/s + 46 us latency
    assert e1.allreduce_s(1) == pytest.approx(1.5 * 16384 / 160e9 + 4.6e-5)
    assert EngineModel(H800, L7, 1).allreduce_s(1000) == 0.0
    # 70B/TP4 decode at batch 1: 34.5 GB per GPU (blocks) / 1.8425 TB/s + 160 all-reduces
    hand = (L70.params - 32000 * 8192) * 2 / 4 / (3.35e12 * 0.55) + 160 * e1.allreduce_s(1) + 1e-3
    assert e1.decode_step_s(1, 0) == pytest.approx(hand, rel=1e-9)
    assert EngineModel(H800, L13, 2).prefill_s(2000) < EngineModel(H800, L13, 1).prefill_s(2000)


def test_kv_capacity_hand_calculation():
    e = EngineModel(H800, L7, 1)
    usable = int(85_520_809_984 * 0.9) - 3_113_851_290  # vLLM budget minus context/graphs
    free = usable - L7.weight_bytes
    assert e.free_kv_bytes_per_gpu() == free
    assert e.kv_capacity_tokens() == (free // (524_288 * 16)) * 16 == 115_152
    assert e.kv_capacity_tokens(10 * 2**30) == (10 * 2**30 // (524_288 * 16)) * 16
    # 70B TP4 with 8 KV heads: each GPU holds 2 heads -> 327680/4 B per token per GPU
    e70 = EngineModel(H800, L70, 4)
    assert e70.kv_bytes_per_token_per_gpu == 327_680 / 4
    # TP beyond the KV head count replicates heads (vLLM): 8 heads over 8 GPUs, not fewer bytes
    assert EngineModel(H800, L70, 8).kv_bytes_per_token_per_gpu == 327_680 / 8
    assert e.free_kv_bytes_per_gpu(resident_bytes_per_gpu=10**12) == 0
    with pytest.raises(EngineInputError, match="free_bytes_per_gpu must be >= 0"):
        e.kv_capacity_tokens(-1)


def test_load_times_hand_calculation():
    # 70B at TP4 over 52 GB/s per GPU: 137.95 GB / 4 / 52e9 = 0.663 s (GPUs load in parallel)
    e = EngineModel(H800, L70, 4)
    assert e.load_s() == pytest.approx(L70.weight_bytes / 4 / 52e9)
    assert e.load_s() == pytest.approx(0.663, rel=0.01)
    assert e.load_s(0) == 0.0
    assert e.load_s(40) == pytest.approx(e.load_s() / 2)
    with pytest.raises(EngineInputError, match="layers must be an integer in"):
        e.load_s(81)


def test_startup_stages_and_paper_plausibility():
    s = H800.startup
    e70 = EngineModel(H800, L70, 4)
    cold = s.process_start_s + s.import_s + s.device_init_s + s.engine_init_s + s.comm_group_s
    assert e70.startup_s() == pytest.approx(cold + s.activation_s)
    assert e70.startup_s(True, True, True) == pytest.approx(s.activation_s)
    assert EngineModel(H800, L7, 1).startup_s(True, True) == pytest.approx(s.activation_s)
    assert e70.cold_start_s() == pytest.approx(e70.startup_s() + e70.load_s())
    # §7.2 plausibility (not a fit): prewarmed 70B first token ~665 ms, and a 29.8-54.8x total
    # reduction vs no prewarm.  Our physics must land within a factor ~2 of both.
    warm = e70.ttft_s(
        1000, resident_layers=80, pooled_process=True, engine_ready=True, comm_group_ready=True
    )
    cold_ttft = e70.ttft_s(1000)
    assert 0.3 < warm < 1.3
    assert 15 < cold_ttft / warm < 110


def test_first_token_streaming_closed_form_examples():
    e = EngineModel(H800, L7, 1)
    c, ell, L = e.layer_compute_s(1000), e.layer_load_s, 32
    head = e.prefill_s(1000) - L * c
    assert e.first_token_after_start_s(L, 1000) == pytest.approx(e.prefill_s(1000))
    # loading (8.1 ms/layer) is slower than compute (0.83 ms/layer): the last layer's arrival
    # bounds the pass -> (L - r) * ell + c
    assert ell > c
    assert e.first_token_after_start_s(16, 1000) == pytest.approx(16 * ell + c + head)
    # without streaming the engine waits for all weights, then computes
    assert e.first_token_after_start_s(16, 1000, streaming=False) == pytest.approx(
        16 * ell + L * c + head
    )
    # a head start longer than the whole copy hides the loading entirely
    assert e.first_token_after_start_s(0, 1000, head_start_s=1.0) == pytest.approx(
        e.prefill_s(1000)
    )


def _simulate_stream(e: EngineModel, r: int, tokens: int, h: float) -> float:
    """Event-by-event recurrence the closed form must equal."""
    c, ell, finish = e.layer_compute_s(tokens), e.layer_load_s, 0.0
    for i in range(e.arch.num_layers):
        arrival = 0.0 if i < r else max(0.0, (i - r + 1) * ell - h)
        finish = max(finish, arrival) + c
    return finish + (e.prefill_s(tokens) - e.arch.num_layers * c)


@settings(max_examples=60, deadline=None)
@given(
    arch=st.sampled_from([("7b", 1), ("13b", 2), ("70b", 4), ("70b", 8)]),
    r_frac=st.floats(0, 1),
    tokens=st.integers(1, 16_000),
    h=st.floats(0, 2),
)
def test_streaming_closed_form_equals_recurrence(arch, r_frac, tokens, h):
    e = EngineModel(H800, ModelArch.llama2(arch[0]), arch[1])
    r = round(r_frac * e.arch.num_layers)
    got = e.first_token_after_start_s(r, tokens, head_start_s=h)
    assert got == pytest.approx(_simulate_stream(e, r, tokens, h), rel=1e-9, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    arch=st.sampled_from([("7b", 1), ("70b", 4)]),
    tokens=st.integers(1, 8000),
    h=st.floats(0, 1),
    tol=st.floats(0, 0.5),
)
def test_min_resident_layers_is_minimal(arch, tokens, h, tol):
    e = EngineModel(H800, ModelArch.llama2(arch[0]), arch[1])
    r = e.min_resident_layers(tokens, head_start_s=h, tolerance=tol)
    bound = e.first_token_after_start_s(e.arch.num_layers, tokens) * (1 + tol) + 1e-12
    assert e.first_token_after_start_s(r, tokens, head_start_s=h) <= bound
    if r > 0:
        assert e.first_token_after_start_s(r - 1, tokens, head_start_s=h) > bound


@settings(max_examples=80, deadline=None)
@given(
    arch=st.sampled_from([("7b", 1), ("13b", 2), ("70b", 4)]),
    n=st.integers(1, 32_000),
    extra=st.integers(1, 4000),
    b=st.integers(1, 256),
    kv=st.integers(0, 500_000),
)
def test_more_tokens_is_never_faster(arch, n, extra, b, kv):
    e = EngineModel(H800, ModelArch.llama2(arch[0]), arch[1])
    assert e.prefill_s(n + extra) >= e.prefill_s(n)
    assert e.decode_step_s(b + 1, kv) >= e.decode_step_s(b, kv)
    assert e.decode_step_s(b, kv + extra) >= e.decode_step_s(b, kv)
    r = min(e.arch.num_layers, n % (e.arch.num_layers + 1))
    if r < e.arch.num_layers:
        assert e.first_token_after_start_s(r, n) >= e.first_token_after_start_s(r + 1, n)


def test_engine_argument_errors():
    e = EngineModel(H800, L7, 1)
    with pytest.raises(EngineInputError, match="tp must be >= 1"):
        EngineModel(H800, L7, 0)
    with pytest.raises(EngineInputError, match="exceeds the 8 GPUs"):
        EngineModel(H800, L7, 16)
    with pytest.raises(EngineInputError, match="prompt_tokens must be integers >= 1"):
        e.prefill_s(0)
    with pytest.raises(EngineInputError, match="at least one prompt"):
        e.prefill_s([])
    with pytest.raises(EngineInputError, match="decode batch"):
        e.decode_step_s(0, 10)
    with pytest.raises(EngineInputError, match="kv_tokens must be >= 0"):
        e.decode_step_s(1, -1)
    with pytest.raises(EngineInputError, match="resident_layers must be an integer"):
        e.first_token_after_start_s(33, 10)
    with pytest.raises(EngineInputError, match="head_start_s"):
        e.first_token_after_start_s(3, 10, head_start_s=-1)
    assert math.isfinite(e.prefill_s(1))


def test_physics_table_rows():
    from warmserve.sim.physics_table import physics_table

    rows = physics_table(H800)
    assert [r["model"] for r in rows] == ["llama2-7b (TP1)", "llama2-13b (TP2)", "llama2-70b (TP4)"]
    for r in rows:
        stages = [
            r[k]
            for k in (
                "ttft_no_prewarm_s",
                "ttft_device_s",
                "ttft_engine_s",
                "ttft_weights_s",
                "ttft_commgroup_s",
            )
        ]
        assert stages == sorted(stages, reverse=True)  # each prewarmed stage only helps
        assert r["total_reduction"] == pytest.approx(stages[0] / stages[-1])


def test_numpy_integers_are_accepted():
    import numpy as np

    e = EngineModel(H800, L7, 1)
    assert e.prefill_s(np.int64(500)) == e.prefill_s(500)
    assert e.prefill_s(np.array([100, 200])) == e.prefill_s([100, 200])
    assert e.decode_step_s(np.int64(4), np.int64(4000)) == e.decode_step_s(4, 4000)
    assert e.load_s(np.int32(3)) == e.load_s(3)
    with pytest.raises(EngineInputError, match="prompt_tokens must be integers"):
        e.prefill_s(3.5)
    with pytest.raises(EngineInputError, match="prompt_tokens must be integers"):
        e.prefill_s([True])
