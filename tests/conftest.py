"""Shared pytest configuration for the whole suite.

The real Kubernetes control plane fixtures (``k8s_control_plane``, ``k8s_namespace``,
``kube_client``, ``kubectl``, ``helm``, ``sa_kubeconfig``) live in the plugin module
``tests/k8s_support.py``, the real small model (``smollm2_dir``) in
``tests/real_model_support.py``; see their docstrings. Fixtures are lazy: tests that don't use
them start nothing.
"""

pytest_plugins = ["tests.k8s_support", "tests.real_model_support"]
