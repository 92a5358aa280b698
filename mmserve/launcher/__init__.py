"""Running engine processes: `supervisor.py` keeps one `vllm serve --headless` alive (no Ray, no vLLM import)."""
