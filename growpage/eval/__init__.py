"""Evaluation helpers: the workload of the engine benchmarks (prompts, retrieval task)."""
