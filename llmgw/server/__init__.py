"""The control plane: ``llmgw server``."""
