"""What a pooled worker imports for the ``vllm`` engine before any model is known (WarmServe §6).

torch, vLLM's engine, its OpenAI server and the ``warmserve_slot`` model loader (registering it
with vLLM).  On a GPU node CUDA is initialised here too, so an activation pays neither the
imports (10-30 s on a loaded CPU) nor CUDA context creation.
"""

from __future__ import annotations

import os

# The engine core and its model run in this process (engines/vllm/inproc.py); on CPU vLLM only
# keeps its in-process executor when V1 multiprocessing is off.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
import uvicorn
import vllm  # noqa: F401
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
from vllm.entrypoints.launchers.api_server.app_state import init_app_state  # noqa: F401
from vllm.entrypoints.launchers.app import build_app  # noqa: F401
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

import warmserve_agent.engines.vllm.engine
import warmserve_agent.engines.vllm.inproc
import warmserve_agent.engines.vllm.loader  # noqa: F401  (registers load_format warmserve_slot)

if torch.cuda.is_available():
    torch.cuda.init()


async def _no_app(scope: object, receive: object, send: object) -> None:
    pass


# uvicorn imports its HTTP/WebSocket protocol and lifespan classes when a config is first loaded
# (~40 ms): here, not in an activation.
uvicorn.Config(_no_app, lifespan="on", log_level="warning").load()
