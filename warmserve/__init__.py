"""warmserve: Kubernetes-native multi-LLM serving with predictive prewarming."""

__version__ = "0.1.0"
