"""Split brain when the leader's poll outlasts its Lease (reliability; docs/operator.md "Leader
election").

A real kube-apiserver + etcd, two agent processes with simulated GPUs, a leader (priority 100) and
a standby (priority 50) as processes under the chart's ServiceAccount.  One agent is made
deliberately slow: while ``slow-describe`` exists its ``Describe`` takes longer than the Lease
(the leader's poll waits for it), as a poll did on a loaded machine when the chaos suite saw the
standby act beside a live leader.  Meanwhile the deployment's ``minInstances`` steps up by one
per slow poll, so every poll has an instance to start.

The check: a watch records every version of the Lease (holder, ``renewTime``); every
``event=action`` an operator logs must fall inside its own Lease: the latest version written at
or before the action names that operator and has not expired.  An action outside it is a second
actor: the other replica held (or could take) the Lease at that moment.

The self-fence cannot recall a call already on its way.  The second test holds the leader's
``BeginGrace`` in flight at the agent (as a partition would), freezes the leader (SIGSTOP) past
its Lease, lets the standby take over and act, then lets the held call through: the agent must
refuse it (fencing tokens, ``warmserve_agent.fencing``).  Without tokens it drained an instance
the new leader wanted serving.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import (
    describe_agents,
    get_json,
    install_for_operator,
    register_gpu_node,
    start_sim_agent,
    write_models,
)

from warmserve.testing.k8s import ControlPlane
from warmserve.testing.procs import Procs, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

LEASE_S = 2  # a whole number: the Lease stores leaseDurationSeconds as an integer
POLL_S = 1.5  # the loop's Describe timeout is max(2 * poll, 2 s) = 3 s: longer than SLOW_S
SLOW_S = 2.6  # one slow Describe: longer than the Lease
ROUNDS = 6  # minInstances steps up, one start per slow poll (8 GPUs, 1 per instance)
PEERING = "fence"

ACTION = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bevent=action verb=(\w+)")
STARTED = re.compile(r"event=operator_started .*identity=(\S+)")


class LeaseLog:
    """Every version of the Lease ``ns/name`` seen by a watch: (renew unix s, holder, duration)."""

    def __init__(self, kubeconfig: Path, ns: str, name: str) -> None:
        from kubernetes import client, config

        self.api = client.CoordinationV1Api(config.new_client_from_config(str(kubeconfig)))
        self.ns, self.name = ns, name
        self.versions: dict[str, tuple[float, str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kubernetes import watch

        rv = ""
        while not self.stop.is_set():
            try:
                for ev in watch.Watch().stream(
                    self.api.list_namespaced_lease,
                    self.ns,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=rv or None,
                    timeout_seconds=2,
                ):
                    obj = ev["object"]
                    rv = obj.metadata.resource_version
                    renew = obj.spec.renew_time
                    self.versions[rv] = (
                        renew.timestamp() if renew else 0.0,
                        obj.spec.holder_identity or "",
                        float(obj.spec.lease_duration_seconds or 0),
                    )
            except Exception:  # a watch that expired or broke: resume from the last version
                rv = ""
                time.sleep(0.1)

    def close(self) -> list[tuple[float, str, float]]:
        self.stop.set()
        self.thread.join(timeout=10)
        return sorted(v for v in self.versions.values() if v[1])


def actions(log: Path) -> list[tuple[float, str]]:
    """(unix s, verb) of every ``event=action`` line (asctime is local time, like ``time``)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = ACTION.match(line)
        if m:
            t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((t, m.group(2)))
    return out


def outside_lease(
    acts: list[tuple[float, str]], me: str, versions: list[tuple[float, str, float]]
) -> list[str]:
    """Actions of ``me`` not covered by its own Lease (``versions`` sorted by renew time)."""
    bad = []
    for t, verb in acts:
        before = [v for v in versions if v[0] <= t]
        if not before:
            bad.append(f"{verb} at {t:.3f}: before any Lease")
            continue
        renew, holder, duration = before[-1]
        if holder != me:
            bad.append(f"{verb} at {t:.3f}: the Lease was {holder}'s (renewed {renew:.3f})")
        elif t > renew + duration:
            bad.append(f"{verb} at {t:.3f}: own Lease expired at {renew + duration:.3f}")
    return bad


class Env:
    def __init__(self, plane: ControlPlane, tmp: Path) -> None:
        self.plane, self.tmp = plane, tmp
        self.procs = Procs(tmp)
        self.ns = plane.create_namespace("fence")
        self.env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "POD_NAMESPACE")}
        self.addresses: dict[str, str] = {}
        self.kubeconfig: Path | None = None
        self.slow = tmp / "slow-describe"
        self.hold, self.release = tmp / "hold-calls", tmp / "release-calls"

    def start_agent(self, node: str) -> None:
        slow = ("--slow-describe-file", str(self.slow))
        held = ("--hold-calls-file", str(self.hold), "--release-calls-file", str(self.release))
        address = start_sim_agent(self.procs, self.tmp, node, self.env, *slow, *held)
        name = f"{self.ns}-{node}"
        self.addresses[name] = address
        register_gpu_node(self.plane.kubectl, name, address)

    def start_operator(self, name: str, priority: int) -> str:
        """Start an operator; returns its identity (the Lease's holder when it leads)."""
        assert self.kubeconfig is not None
        argv = [
            *(sys.executable, "-m", "warmserve", "operator"),
            *("--window-seconds", "5", "--poll-seconds", str(POLL_S)),
            *("--lease-seconds", str(LEASE_S)),
            *("--renew-deadline-seconds", "1.5", "--retry-period-seconds", "0.3"),
            *("--peering-lifetime", "5", "--peering", PEERING, "--priority", str(priority)),
            *("--metrics-port", "0", "--scale-down-delay", "1", "--max-grace", "3"),
            *("--namespace", self.ns, "--history-namespace", self.ns),
        ]
        self.procs.start(name, argv, {**self.env, "KUBECONFIG": str(self.kubeconfig)})
        log = self.tmp / f"{name}.log"
        deadline = time.monotonic() + 90
        while not (m := STARTED.search(log.read_text() if log.exists() else "")):
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.2)
        return m.group(1)[:128]

    def logs(self) -> str:
        return "\n".join(self.procs.log(n, 30) for n in list(self.procs.procs))

    def set_min(self, n: int) -> None:
        patch = json.dumps({"spec": {"minInstances": n}})
        self.plane.kubectl("patch", "wsmd", "chat", "-n", self.ns, "--type=merge", "-p", patch)

    def serving(self) -> int:
        return len(self.serving_ids())

    def serving_ids(self) -> set[str]:
        snaps = describe_agents(self.addresses)
        return {
            i.instance_id
            for s in snaps.values()
            for i in s.instances
            if i.model == "tiny-chat" and i.phase.value != "grace"
        }

    def agent_log(self) -> str:
        return "".join(
            (self.tmp / f"{n}.log").read_text(errors="replace") for n in ("node-a", "node-b")
        )


@pytest.fixture
def env(k8s_bin_dir: Path, tmp_path: Path) -> Iterator[Env]:
    plane = ControlPlane.start(tmp_path / "plane", bin_dir=k8s_bin_dir)
    e = Env(plane, tmp_path)
    try:
        e.kubeconfig, e.env = install_for_operator(
            plane.kubectl, plane.helm, plane.sa_kubeconfig, e.ns, f"fe{e.ns[-8:]}"
        )
        write_models(tmp_path / "models")
        e.start_agent("node-a")
        e.start_agent("node-b")
        body = {
            "apiVersion": "warmserve.io/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "chat", "namespace": e.ns},
            "spec": {"model": {"name": "tiny-chat"}, "maxBatchSize": 4, "minInstances": 1},
        }
        plane.kubectl("apply", "-f", "-", input=json.dumps(body))
        yield e
    finally:
        e.procs.stop_all()
        plane.stop()


def test_a_slow_poll_never_makes_two_actors(env: Env) -> None:
    assert env.plane.kubeconfig is not None
    lease = LeaseLog(env.plane.kubeconfig, env.ns, f"{PEERING}-loop")
    leader = env.start_operator("operator-leader", 100)
    wait_for(lambda: env.serving() == 1, "the leader starts minInstances", 90, env.logs)
    standby = env.start_operator("operator-standby", 50)
    time.sleep(2 * POLL_S)  # the standby polls beside the live leader
    env.slow.write_text(str(SLOW_S))
    t_slow = time.time()
    try:
        for k in range(ROUNDS):
            env.set_min(2 + k)
            time.sleep(SLOW_S + 0.4)
    finally:
        env.slow.unlink()
    env.set_min(1)
    time.sleep(3 * POLL_S)  # the last calls land
    versions = lease.close()
    acts = {
        leader: actions(env.tmp / "operator-leader.log"),
        standby: actions(env.tmp / "operator-standby.log"),
    }
    during = sum(1 for a in acts.values() for t, _ in a if t >= t_slow)
    bad = {who: outside_lease(a, who, versions) for who, a in acts.items()}
    holders = [h for _, h, _ in versions]
    changes = sum(1 for a, b in itertools.pairwise(holders) if a != b)
    print(
        f"slow polls: {during} actions, {len(versions)} Lease versions, {changes} holder "
        f"changes; outside their Lease: leader {len(bad[leader])}, standby {len(bad[standby])}"
    )
    assert during >= ROUNDS // 2, f"too few actions to judge ({during})\n{env.logs()}"
    assert not bad[leader] and not bad[standby], (
        f"two actors: actions outside the actor's own Lease: {bad}\n"
        f"Lease versions (renew, holder, duration): {versions}\n{env.logs()}"
    )
    assert not acts[standby], f"the standby acted beside a live leader: {acts[standby]}"


def test_a_deposed_leaders_call_in_flight_is_refused_by_the_agent(env: Env) -> None:
    leader = env.start_operator("operator-leader", 100)
    env.set_min(2)
    wait_for(lambda: env.serving() == 2, "the leader starts minInstances=2", 90, env.logs)
    env.start_operator("operator-standby", 50)
    time.sleep(2 * POLL_S)  # the standby polls beside the live leader
    term = get_json(env.plane.kubectl, "lease", f"{PEERING}-loop", "-n", env.ns)["spec"]
    before = env.serving_ids()
    env.hold.write_text("")  # calls that reach an agent from now on stay in flight
    env.set_min(1)  # the leader drains one instance: its BeginGrace is held
    wait_for(
        lambda: "event=call_held method=BeginGrace" in env.agent_log(),
        "the leader's BeginGrace is in flight",
        60,
        env.logs,
    )
    env.procs.procs["operator-leader"].send_signal(signal.SIGSTOP)  # frozen past its Lease
    env.hold.unlink()
    try:
        env.set_min(3)
        wait_for(
            lambda: env.serving() == 3,
            "the standby took over and started a third instance",
            90,
            env.logs,
        )
        standby_acts = actions(env.tmp / "operator-standby.log")
        assert any(verb == "activate" for _, verb in standby_acts), standby_acts
        env.release.write_text("")  # the deposed leader's call arrives now
        wait_for(
            lambda: "event=call_released method=BeginGrace" in env.agent_log(),
            "the held BeginGrace reaches the agent's service",
            30,
            env.logs,
        )
        time.sleep(1.5)  # what it would do, done
        drained = before - env.serving_ids()
        assert not drained, (
            f"the deposed leader's BeginGrace drained {drained} after the new leader took "
            f"over (it wants 3 serving)\n{env.logs()}"
        )
        fenced = re.findall(
            r"event=call_fenced method=BeginGrace token=(\d+) highest=(\d+) reason=stale",
            env.agent_log(),
        )
        assert fenced and all(int(t) < int(h) for t, h in fenced), env.logs()
        print(f"the agent refused the deposed leader's BeginGrace: token/highest {fenced}")
    finally:
        env.procs.procs["operator-leader"].send_signal(signal.SIGCONT)
    wait_for(
        lambda: "event=leadership_lost" in (env.tmp / "operator-leader.log").read_text(),
        "the resumed leader stops leading",
        30,
        env.logs,
    )
    assert env.serving() == 3
    # The standby's term came after the leader's (the leader, with the higher priority, may
    # since have asked for the Lease back: a third term).
    now = get_json(env.plane.kubectl, "lease", f"{PEERING}-loop", "-n", env.ns)["spec"]
    assert term["holderIdentity"] == leader and term.get("leaseTransitions", 0) >= 1, term
    assert now["leaseTransitions"] > term["leaseTransitions"], (term, now)
    assert "event=leadership_acquired" in (env.tmp / "operator-standby.log").read_text()
