"""megalite: a compact Megatron-style 3D-parallel GPT pretraining framework."""

__version__ = "0.1.0"
