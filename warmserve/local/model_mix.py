"""The model mix of ``warmserve up``: configuration, stand-in weights, ModelDeployments.

The configuration is ``warmserve/data/examples/up.yaml`` (commented there).  Bytes are simulated
at ``1/byte_scale`` (1/1024): the agents get GPUs of ``size / 1024`` and each model gets real
safetensors of ``weight_gib`` MiB with its real layer count, so prewarm slots, placement and KV
memory keep the proportions of the real cluster while an 8x80 GiB node fits in RAM.  The agents
pace copies at ``copy_gib_per_s / 1024`` (``--sim-copy-gbps``), so a load takes the time the
real one takes; a cold start therefore lasts seconds, a prewarm hit does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from warmserve.modelref import store_dirname

GIB = 1024**3
MIB = 1024**2


class UpConfigError(ValueError):
    """A configuration ``warmserve up`` cannot use; one line naming the field."""


@dataclass(frozen=True)
class LocalModel:
    name: str
    weight_gib: float
    layers: int
    tp: int
    max_batch: int
    max_instances: int
    trace_day: int
    prefill_tok_s: float
    decode_tok_s: float
    kv_kib_per_token: float
    # A warmserve.realmodel name: the model serves those real weights on the vllm engine
    # (``up --engine vllm``); empty: stand-in weights on the simulated engine.
    real: str = ""
    engine_args: tuple[str, ...] = ()
    engine_start_s: float = 0.0  # an engine's own start on top of the load (vLLM builds one)


ENGINES = ("simulated", "vllm")


@dataclass(frozen=True)
class ModelMix:
    name: str
    byte_scale: int
    copy_gib_per_s: float
    models: tuple[LocalModel, ...]
    arrivals: str
    lengths: str
    rps: float
    alpha: float
    history_days: int
    start: str | int
    warmup_windows: int
    seed: int
    window_s: float
    scale_down_delay_s: float
    max_grace_s: float
    max_hold_s: float
    max_queue: int
    engine: str = "simulated"
    max_input_tokens: int = 0  # caps on the lengths trace's requests (0: none)
    max_output_tokens: int = 0

    @property
    def copy_bytes_per_s(self) -> float:
        """Pacing of the agents' simulated copies (bytes of the stand-in weights per second)."""
        return self.copy_gib_per_s * GIB / self.byte_scale

    def cold_start_s(self, m: LocalModel) -> float:
        """T_c of Eq. 7-8: the seconds a whole load takes here (shards load in parallel)."""
        return round(self.weight_bytes(m) / m.tp / self.copy_bytes_per_s + m.engine_start_s, 2)

    def weight_bytes(self, m: LocalModel) -> int:
        return int(m.weight_gib * GIB / self.byte_scale)


def _num(d: dict[str, Any], key: str, where: str, *, minimum: float = 0.0) -> float:
    v = d.get(key)
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or not math.isfinite(v)
        or v <= minimum
    ):
        raise UpConfigError(f"{where}.{key} must be a number > {minimum:g}, got {v!r}")
    return float(v)


def parse(doc: Any, source: str = "up.yaml") -> ModelMix:
    if not isinstance(doc, dict):
        raise UpConfigError(f"{source}: not a mapping")
    models = []
    for i, m in enumerate(doc.get("models") or []):
        where = f"{source}: models[{i}]"
        name = str(m.get("name", ""))
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{0,62}", name):
            raise UpConfigError(f"{where}.name must be a DNS label, got {name!r}")
        args = m.get("engine_args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise UpConfigError(f"{where}.engine_args must be a list of strings")
        models.append(
            LocalModel(
                name=name,
                weight_gib=_num(m, "weight_gib", where),
                layers=int(_num(m, "layers", where)),
                tp=int(_num(m, "tp", where)),
                max_batch=int(_num(m, "max_batch", where)),
                max_instances=int(_num(m, "max_instances", where)),
                trace_day=int(_num(m, "trace_day", where, minimum=-1)),
                prefill_tok_s=_num(m, "prefill_tok_s", where),
                decode_tok_s=_num(m, "decode_tok_s", where),
                kv_kib_per_token=_num(m, "kv_kib_per_token", where),
                real=str(m.get("real") or ""),
                engine_args=tuple(args),
                engine_start_s=float(m.get("engine_start_s") or 0.0),
            )
        )
    if not models:
        raise UpConfigError(f"{source}: no models")
    wl, pol, gw = doc.get("workload") or {}, doc.get("policy") or {}, doc.get("gateway") or {}
    engine = str(doc.get("engine", "simulated"))
    if engine not in ENGINES:
        raise UpConfigError(f"{source}: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "simulated" and any(m.real for m in models):
        raise UpConfigError(f"{source}: real models need engine: vllm")
    caps = {k: int(doc.get(k) or 0) for k in ("max_input_tokens", "max_output_tokens")}
    if any(v < 0 for v in caps.values()):
        raise UpConfigError(f"{source}: max_input_tokens and max_output_tokens must be >= 0")
    return ModelMix(
        name=str(doc.get("name", "up")),
        byte_scale=int(_num(doc, "byte_scale", source)),
        copy_gib_per_s=_num(doc, "copy_gib_per_s", source),
        models=tuple(models),
        arrivals=str(wl.get("arrivals", "")),
        lengths=str(wl.get("lengths", "")),
        rps=_num(wl, "rps", f"{source}: workload"),
        alpha=_num(wl, "alpha", f"{source}: workload", minimum=-1e-12),
        history_days=int(_num(wl, "history_days", f"{source}: workload", minimum=-1)),
        start=wl.get("start", "busiest"),
        warmup_windows=int(_num(wl, "warmup_windows", f"{source}: workload", minimum=-1)),
        seed=int(wl.get("seed", 0)),
        window_s=_num(pol, "window_s", f"{source}: policy"),
        scale_down_delay_s=_num(pol, "scale_down_delay_s", f"{source}: policy"),
        max_grace_s=_num(pol, "max_grace_s", f"{source}: policy"),
        max_hold_s=_num(gw, "max_hold_s", f"{source}: gateway"),
        max_queue=int(_num(gw, "max_queue", f"{source}: gateway")),
        engine=engine,
        **caps,
    )


def load_default(engine: str = "simulated") -> ModelMix:
    """``up.yaml`` (the simulated engine) or ``up-vllm.yaml`` (``--engine vllm``)."""
    name = "up.yaml" if engine == "simulated" else f"up-{engine}.yaml"
    text = (resources.files("warmserve.data") / "examples" / name).read_text()
    return parse(yaml.safe_load(text), name)


# ---- stand-in weights ---------------------------------------------------------------------------

# Layer-0 embeddings and the last layer's head each take this share of the bytes; the transformer
# blocks share the rest evenly (as in a real checkpoint, where blocks dominate).
_EDGE_SHARE = 0.02
_HIDDEN = 64  # row width of every stand-in tensor; only the byte counts matter


def write_weights(mix: ModelMix, root: Path, real: dict[str, Path] | None = None) -> Path:
    """Write each model's stand-in checkpoint under ``root`` (skipped when already written for
    this configuration), or link a real model's files (``real``: realmodel name -> its verified
    directory); returns ``root``."""
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    for idx, m in enumerate(mix.models):
        d = root / store_dirname(m.name)  # the agent's store layout (warmserve.modelref)
        if m.real:
            link_real(d, (real or {})[m.real])
            continue
        profile = {
            "max_batch": m.max_batch,
            "prefill_tok_s": m.prefill_tok_s,
            "decode_tok_s": m.decode_tok_s,
            "kv_bytes_per_token": max(1, round(m.kv_kib_per_token * 1024 / mix.byte_scale)),
        }
        cfg = {"num_hidden_layers": m.layers, "hidden_size": _HIDDEN, "warmserve": profile}
        stamp = hashlib.sha256(json.dumps([cfg, mix.weight_bytes(m), idx]).encode()).hexdigest()
        if (d / ".stamp").is_file() and (d / ".stamp").read_text() == stamp:
            continue
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("*.safetensors"):
            old.unlink()
        total = mix.weight_bytes(m)
        edge_rows = max(1, int(total * _EDGE_SHARE / (2 * _HIDDEN)))
        layer_rows = max(1, int(total * (1 - 2 * _EDGE_SHARE) / m.layers / (2 * _HIDDEN)))
        rng = np.random.default_rng(idx + 1)

        def t(rows: int, rng: np.random.Generator = rng) -> np.ndarray:
            return rng.standard_normal((rows, _HIDDEN), dtype=np.float32).astype(np.float16)

        tensors = {"model.embed_tokens.weight": t(edge_rows)}
        for i in range(m.layers):
            tensors[f"model.layers.{i}.mlp.weight"] = t(layer_rows)
        tensors["model.norm.weight"] = t(1)
        tensors["lm_head.weight"] = t(edge_rows)
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg))
        (d / ".stamp").write_text(stamp)
    return root


def link_real(dest: Path, src: Path) -> None:
    """A real model's files in the store (hard links: the cache is verified, read-only to us)."""
    import os
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("WARMSERVE-"):
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)


# ---- ModelDeployments ---------------------------------------------------------------------------


def model_deployments(mix: ModelMix, namespace: str, *, prewarm: bool) -> list[dict[str, Any]]:
    """One ModelDeployment per model; ``prewarm=False`` is the reactive baseline (same specs,
    no prewarm replicas: every start is cold)."""
    out = []
    for m in mix.models:
        out.append(
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {
                    "name": m.name,
                    "namespace": namespace,
                    "labels": {"app.kubernetes.io/part-of": "warmserve-up"},
                },
                "spec": {
                    "model": {"name": m.name, "coldStartSeconds": mix.cold_start_s(m)},
                    "tensorParallel": m.tp,
                    "maxBatchSize": m.max_batch,
                    "ttftObjectiveSeconds": 1.0,
                    "minInstances": 0,
                    "maxInstances": m.max_instances,
                    "prewarm": {"enabled": prewarm},
                    "gateway": {"maxQueue": mix.max_queue, "maxHoldSeconds": mix.max_hold_s},
                },
            }
        )
        if m.real:  # real weights: the vllm engine (the agents' default stays simulated)
            out[-1]["spec"]["engine"] = {"name": "vllm", "args": list(m.engine_args)}
    return out


def parse_gpus(text: str) -> tuple[int, int, float]:
    """``2x8x80GiB`` -> (nodes, GPUs per node, GiB per GPU)."""
    m = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+(?:\.\d+)?)\s*(GiB|GB|G)?\s*", text)
    if not m:
        raise UpConfigError(
            f"--gpus must look like 2x8x80GiB (nodes x GPUs x memory), got {text!r}"
        )
    nodes, gpus, gib = int(m.group(1)), int(m.group(2)), float(m.group(3))
    if not 1 <= nodes <= 16:
        raise UpConfigError(f"--gpus: 1-16 nodes, got {nodes}")
    if not 1 <= gpus <= 16:
        raise UpConfigError(f"--gpus: 1-16 GPUs per node, got {gpus}")
    if not 1 <= gib <= 1024:
        raise UpConfigError(f"--gpus: 1-1024 GiB per GPU, got {gib:g}")
    return nodes, gpus, gib


def simulated_gpus_flag(gpus: int, gib: float, byte_scale: int) -> str:
    """The agent's ``--simulate-gpus`` value at the byte scale (8x80GiB -> 8x80MiB)."""
    mib = gib * 1024 / byte_scale
    return f"{gpus}x{mib:g}MiB" if mib == int(mib) else f"{gpus}x{int(mib * 1024)}KiB"
