"""Helpers of ``test_real_engine_e2e.py`` (and ``test_real_engine_tp_e2e.py``): the two real
models in an agent's store, plain vLLM's greedy reference computed in a process of its own (while
the stack starts), and a recorder of what the agent reports (slots, instances, lending) between
the operator's moves."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmserve.modelref import store_dirname

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24  # the answer ends (EOS) well before: both sides stop on their own
ENGINE_ARGS = ["--enforce-eager", "--max-model-len=512"]

# Plain vLLM with its in-process engine core, on the same files in the slot's dtype (bf16, the
# checkpoint's): the same weights and greedy sampling as the engine over the slot.
REFERENCE = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
d, question, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=d, dtype="bfloat16", enforce_eager=True, max_model_len=512,
          kv_cache_memory_bytes=64 * 1024**2)
out = llm.chat([{"role": "user", "content": question}], SamplingParams(max_tokens=n, temperature=0))
c = out[0].outputs[0]
print("RESULT " + json.dumps({"prompt": list(out[0].prompt_token_ids), "tokens": list(c.token_ids),
                              "text": c.text, "finish": c.finish_reason}))
"""


def vllm_deployment(ns: str, name: str, tp: int = 1) -> dict[str, Any]:
    """A ModelDeployment of ``name`` on the real engine, scaled from zero, its requests held up
    to 10 minutes (a vLLM start on a loaded 2-core machine)."""
    spec: dict[str, Any] = {
        "model": {"name": name, "coldStartSeconds": 30},
        "engine": {"name": "vllm", "args": ENGINE_ARGS},
        "maxBatchSize": 4,
        "minInstances": 0,
        "maxInstances": 1,
        "gateway": {"maxHoldSeconds": 600, "maxQueue": 16},
    }
    if tp != 1:
        spec["tensorParallel"] = tp
    return {
        "apiVersion": "warmserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def status_of(st: Any, name: str) -> dict[str, Any]:
    """The ModelDeployment's status (empty until the operator wrote one); ``st``: a Stack."""
    return st.get("wsmd", name).get("status") or {}


def store_models(src: Path, root: Path, names: tuple[str, ...]) -> Path:
    """The real model under each of ``names`` in an agent's store at ``root`` (hard links where
    the file system allows: the cache is read-only to tests and 270 MB a copy)."""
    for name in names:
        dest = root / store_dirname(name)
        dest.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name.startswith("WARMSERVE-") or not f.is_file():
                continue
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)
    return root


class Reference:
    """Plain vLLM's greedy answer, computed in a subprocess started at once (``script`` gets
    the model directory, the question and the token limit as arguments)."""

    def __init__(
        self,
        model_dir: Path,
        log: Path,
        script: str = REFERENCE,
        env: dict[str, str] | None = None,
    ) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "HF_HUB_OFFLINE": "1",
            **(env or {}),
        }
        self._log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, str(model_dir), QUESTION, str(MAX_TOKENS)],
            stdout=subprocess.PIPE,
            stderr=self._out,
            text=True,
            env=env,
        )

    def result(self, timeout: float = 600) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=timeout)
        self._out.close()
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        tail = self._log.read_text(errors="replace")[-3000:]
        assert line, f"plain vLLM exited {self.proc.returncode}:\n{tail}"
        return json.loads(line[7:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@dataclass
class Seen:
    """What the recorder saw, per model: the most lent by a grace instance, GPU states, etc."""

    slots: dict[str, set[tuple[str, str]]] = field(default_factory=dict)  # model -> {(slot, st)}
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> last view
    grace_lent: dict[str, int] = field(default_factory=dict)  # model -> max lent/lendable bytes
    gpu_states: list[str] = field(default_factory=list)  # GPU 0's states, changes only
    together: bool = False  # both models' slots resident on GPU 0 at once, no instance


class AgentRecorder:
    """Polls one agent's Describe every 0.2 s in a thread (the grace period of an idle instance
    lasts about one operator poll) and keeps what the test asserts on."""

    def __init__(self, address: str, models: tuple[str, str]) -> None:
        self.address = address
        self.models = models
        self.seen = Seen()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from warmserve.api.agent import wire
        from warmserve.api.agent.client import SyncAgentClient

        with SyncAgentClient(self.address) as c:
            while not self._stop.is_set():
                # the agent may be busy starting an engine: poll again
                with contextlib.suppress(Exception):
                    self._note(c.describe(), wire)
                time.sleep(0.2)

    def _note(self, d: Any, wire: Any) -> None:
        s = self.seen
        for sl in d.slots:
            s.slots.setdefault(sl.model, set()).add((sl.slot_id, wire.slot_state(sl.state).value))
        state = wire.worker_state(d.gpus[0].state).value
        if not s.gpu_states or s.gpu_states[-1] != state:
            s.gpu_states.append(state)
        ready = {sl.model for sl in d.slots if sl.layers_resident == sl.layers_total}
        if set(self.models) <= ready and not d.instances:
            s.together = True
        for i in d.instances:
            view = {
                "model": i.model,
                "phase": wire.instance_phase(i.phase).value,
                "prewarm_hit": i.prewarm_hit,
                "gpus": list(i.gpus),
                "engine": i.engine,
            }
            s.instances[i.instance_id] = view
            if i.grace_started_unix:
                lent = max(int(i.lendable_bytes), int(i.lent_bytes))
                s.grace_lent[i.model] = max(s.grace_lent.get(i.model, 0), lent)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
