"""The cluster scale: the Megatron-Core backend (models, weights, parallelism, CP Gated DeltaNet), the cluster
presets, launch and the GPU check. Machinery; the trainer process that drives it is trainer.py."""
