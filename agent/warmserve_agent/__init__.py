"""warmserve_agent: the WarmServe node agent.

One agent per node owns the node's GPUs: a long-lived worker process per GPU, prewarm slots over
a per-GPU page pool (simulated or CUDA VMM), a node-local weight store and loader, and engines
hosted in the workers.  The operator drives it over gRPC (``warmserve.agent.v1``, see
``proto/``); :mod:`warmserve.api.agent.client` is the Python client.  See docs/agent.md.
"""

__version__ = "0.1.0"
