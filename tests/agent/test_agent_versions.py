"""The runtime versions the package declares can run the gRPC code it ships.

The generated modules check their runtime at import: ``agent_pb2_grpc`` raises unless grpcio is
at least the grpcio-tools version that generated it, and ``agent_pb2`` calls protobuf's
``ValidateProtobufRuntimeVersion`` with the protoc version.  A declared minimum below those would
let pip install an agent that cannot start (GPU images often carry older grpcio/protobuf);
``hack/gpu-wheels.txt`` carries wheels for that case.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "warmserve" / "api" / "agent" / "v1"


def _ver(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _declared() -> dict[str, tuple[int, ...]]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for req in meta["dependencies"] + meta["optional-dependencies"]["dev"]:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", req)
        if m:
            out[m.group(1).lower()] = _ver(m.group(2))
    return out


def generated_versions() -> dict[str, tuple[int, ...]]:
    grpc_src = (GEN / "agent_pb2_grpc.py").read_text()
    pb_src = (GEN / "agent_pb2.py").read_text()
    grpc_v = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_src)
    pb_v = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", pb_src)
    assert grpc_v and pb_v, "generated code no longer states its runtime versions"
    return {"grpcio": _ver(grpc_v.group(1)), "protobuf": tuple(int(x) for x in pb_v.groups())}


def test_declared_minimums_cover_the_generated_code() -> None:
    gen = generated_versions()
    declared = _declared()
    assert declared["grpcio"] >= gen["grpcio"], (declared["grpcio"], gen["grpcio"])
    assert declared["grpcio-health-checking"] >= gen["grpcio"]
    assert declared["grpcio-tools"] >= gen["grpcio"]
    assert declared["protobuf"] >= gen["protobuf"], (declared["protobuf"], gen["protobuf"])


def test_gpu_wheel_list_carries_runtimes_new_enough() -> None:
    """The wheels hack/gpu-check.sh installs where the GPU image's are older."""
    gen = generated_versions()
    pins = {}
    for line in (ROOT / "hack" / "gpu-wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split()[0].split("==")
            pins[name.lower()] = _ver(version)
    assert pins["grpcio"] >= gen["grpcio"] and pins["grpcio-health-checking"] >= gen["grpcio"]
    assert pins["protobuf"] >= gen["protobuf"]
