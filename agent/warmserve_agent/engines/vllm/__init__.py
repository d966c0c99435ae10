"""The ``vllm`` engine (see ``engine.py``); importing this package imports nothing heavy."""
