"""The cluster scale: the Megatron-Core trainer backend, the weight publish to the rollout engines, and the launcher.
Machinery; the trainer process that drives it is trainer.py.

Start with launch.py (`python -m cluster.launch check|launch|sglang-cmd|gpu-check`): presets.py is what each cluster
run asks for, publish.py the weight publish under the publish barrier (SGLang's endpoints), gpu_check.py the
one-GPU check. The Megatron backend: mcore.py (the models and the training-step interface), mcore_convert.py (HF <->
Megatron state dicts), mcore_weights.py (those weights into and out of a built model), mcore_parallel.py (context and
pipeline parallel, the distributed optimizer), cp_gdn.py (the context-parallel gated delta rule), mcore_cpu.py
(Megatron-Core on a CUDA-less torch).
"""
