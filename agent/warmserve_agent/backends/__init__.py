"""Memory backends for prewarm slots: ``simulated`` (CI) and ``cuda`` (CUDA VMM via cuda-python).

``cuda`` is imported lazily: ``from warmserve_agent.backends.cuda import CudaBackend`` works
without cuda-python installed; constructing it without a driver module raises a clear error.
"""
