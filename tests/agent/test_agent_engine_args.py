"""The agent's own check of engine arguments (defence in depth behind the operator's admission),
over real gRPC with mutual TLS, and its flags."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from warmserve_agent.testing import AgentThread

from tests.agent.agent_support import cfg_for
from tests.agent.test_agent_grpc import code_of
from tests.tls_support import WarmservePki, warmserve_pki
from warmserve.api.agent.client import SyncAgentClient, pb
from warmserve.cli import main


def _mtls_agent(
    tmp_path: Path, model_root: Path, **kw: object
) -> tuple[AgentThread, WarmservePki]:
    pki = warmserve_pki(tmp_path / "pki")
    cfg = cfg_for(
        tmp_path,
        model_root,
        tls_cert=pki.agent.crt,
        tls_key=pki.agent.key,
        client_ca=pki.agent.ca,
        **kw,
    )
    return AgentThread(cfg), pki


def _client(a: AgentThread, pki: WarmservePki) -> SyncAgentClient:
    return SyncAgentClient(
        a.address,
        ca_cert=pki.agent.ca,
        server_name="warmserve-agent",
        client_cert=pki.operator.crt,
        client_key=pki.operator.key,
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--trust-remote-code"], "--trust-remote-code"),
        (["--max-model-len", "64", "--tokenizer", "attacker/repo"], "--tokenizer"),
        (["--worker-extension-cls=evil.Ext"], "--worker-extension-cls"),
        (["--compilation-config.backend", "evil.backend"], "--compilation-config.backend"),
    ],
)
def test_agent_refuses_a_disallowed_arg_over_mtls(
    tmp_path: Path, model_root: Path, args: list[str], named: str
) -> None:
    a, pki = _mtls_agent(tmp_path, model_root)
    with a, _client(a, pki) as c:
        code, msg = code_of(lambda: c.activate("alpha", [0], engine_args=args))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert named in msg and "not allowed for tenants" in msg, msg
        d = c.describe()
        assert not d.instances and all(g.state == pb.WORKER_STATE_IDLE for g in d.gpus)
        # allowed arguments still start an instance
        r = c.activate("alpha", [0], engine_args=["--max-model-len=64", "--enforce-eager"])
        assert r.instance.model == "alpha"


def test_agent_allows_what_its_admin_widened(tmp_path: Path, model_root: Path) -> None:
    from warmserve.engine_args import EngineArgPolicy

    with AgentThread(cfg_for(tmp_path, model_root)) as a, SyncAgentClient(a.address) as c:
        code, msg = code_of(lambda: c.activate("alpha", [0], engine_args=["--disable-log-stats"]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "--allow-engine-arg disable_log_stats" in msg, msg
    widened = EngineArgPolicy.from_admin(["disable-log-stats"])
    cfg = cfg_for(tmp_path, model_root, engine_policy=widened)
    with AgentThread(cfg) as a, SyncAgentClient(a.address) as c:
        assert c.activate("alpha", [0], engine_args=["--disable-log-stats"]).instance.instance_id
        # widening one argument widens nothing else
        code, msg = code_of(lambda: c.activate("alpha", [1], engine_args=["--trust-remote-code"]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--trust-remote-code" in msg


def test_agent_cli_refuses_to_widen_code_execution(
    model_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["agent", "--simulate-gpus", "1x4MiB", "--page-size", "64KiB"]
    base += ["--model-dir", str(model_root), "--memory-dir", str(tmp_path / "mem")]
    for flags, why in (
        (["--allow-engine-arg", "trust_remote_code"], "only --unsafe-allow-code-engine-arg"),
        (["--allow-engine-arg=--worker-extension-cls"], "it can run code on the GPU node"),
        (["--unsafe-allow-code-engine-arg", "model"], "model: set by warmserve"),
        (["--allow-engine-arg", "no_such_arg"], "no_such_arg: not a vLLM engine argument"),
    ):
        assert main([*base, *flags]) == 2
        assert why in capsys.readouterr().err
