"""kvoffload: offload KV-cache blocks to a CPU block pool and back."""
