"""``growpage bench``: benchmarks a user runs against a deployment, named as ``vllm bench``'s.

``serve`` (``serve.py``) is a load client for any OpenAI-compatible server; ``throughput`` and
``latency`` (``offline.py``) run the engine offline; ``workload.py`` makes their requests and
``report.py`` their tables and JSON. A face (docs/architecture.md): nothing below imports it.
"""
