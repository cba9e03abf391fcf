"""The cluster presets: what each cluster run asks for (nodes, GPUs, the trainer's W, the SGLang servers, the memory
budget, environment variables, packages). Standard library only, so `python -m cluster.launch --help` can list them
before torch loads; cluster/launch.py checks a preset and runs it.

Departure from the paper: the node counts are ours: 122B on 16 nodes x 8 GPUs (64 trainer GPUs, 8 SGLang servers of
TP = EP = 8); the one-node 35B preset colocates trainer and engine (the engine releases its memory), so it runs
synchronously. The CPU rehearsal (cpu-rehearsal) runs the launcher's path on this CPU.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class ClusterPreset:
    name: str
    model: str
    """infra.MODEL_SHAPES key (the memory model's architecture)"""
    hf_repo: str
    """Hugging Face repo of the weights (named in messages only: nothing is downloaded)"""
    nodes: int
    gpus_per_node: int
    train_gpus: int
    """W of the trainer's plan (actor and critic co-resident on the same W GPUs)"""
    engine_tp: int
    """GPUs per SGLang server (TP = EP inside the server, one node)"""
    n_engines: int
    tokens: int = 16384
    """T: tokens per device per micro-batch (infra.py's planner)"""
    mem_gib: float = 95.0
    """M: per-device budget of each network (paper: ~95 GiB each, co-resident)"""
    gpu_mem_gib: float = 130.0
    """smallest GPU memory accepted (H200: 141 GB = 131 GiB reported by nvidia-smi as ~143771 MiB)"""
    colocate: bool = False
    """engines share the trainer's GPUs (release their memory while the trainer runs)"""
    env_vars: tuple = ("DAYTONA_API_KEY",)
    model_path_env: str = "T1_MODEL_PATH"
    device: str = "gpu"
    """gpu: SGLang servers, Daytona, GPUs; cpu: the rehearsal (embedded engines, bubblewrap, gloo trainer ranks)"""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


CLUSTER_PRESETS = {
    "qwen35-122b-a10b": ClusterPreset("qwen35-122b-a10b", "qwen35-122b-a10b", "Qwen/Qwen3.5-122B-A10B",
                                      nodes=16, gpus_per_node=8, train_gpus=64, engine_tp=8, n_engines=8),
    "qwen35-35b-a3b": ClusterPreset("qwen35-35b-a3b", "qwen35-35b-a3b", "Qwen/Qwen3.5-35B-A3B",
                                    nodes=1, gpus_per_node=8, train_gpus=8, engine_tp=8, n_engines=1,
                                    colocate=True, tokens=8192),  # T = 16384 fits no plan once the behaviour
    # copy of the actor is counted (infra.py: best 100.6 GiB > M = 95; 93.8 GiB at T = 8192)
    # the whole cluster path on this CPU: 4 gloo trainer ranks ("devices") under the planner's plan, one embedded
    # engine taking the publish over a gloo group, bubblewrap jails; its model is the embedded SFT's checkpoint
    "cpu-rehearsal": ClusterPreset("cpu-rehearsal", "t1-tiny", "(a checkpoint written by the embedded SFT)",
                                   nodes=1, gpus_per_node=0, train_gpus=4, engine_tp=1, n_engines=1, tokens=4096,
                                   mem_gib=6.0, gpu_mem_gib=0.0, env_vars=(), device="cpu"),  # M: the memory
    # model's fixed 4 GiB a device (CUDA context, buffers) is counted on the CPU too
}
CPU_PACKAGES = {"megatron.core": "megatron-core", "ray": "ray"}  # what the rehearsal needs beyond requirements.txt
PACKAGES = {"sglang": "sglang", "megatron.core": "megatron-core", "ray": "ray", "daytona": "daytona",
            "transformer_engine": "transformer-engine"}
