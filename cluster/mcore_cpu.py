"""Megatron-Core 0.16.1 on a CUDA-less torch: what the Megatron backend needs to build and run its models on the CPU
(the tests, the CPU rehearsal), and the two stand-ins it also uses on a GPU node.

- `init_cpu`: a one-process group and Megatron's parallel state (all sizes 1) unless the trainer set them, a no-op
  CUDA RNG tracker (dropout is 0 and weights are loaded, so Megatron's model-parallel RNG has nothing to do), and
  Megatron's own torch gated delta rule wherever flash-linear-attention is missing (a GPU node without it: slower,
  the same numbers).
- `cpu_shims`: torch.cuda.current_device -> "cpu" inside a block (rotary embedding, router weight moves, DDP buffers).
- Megatron's fused functions (megatron.core.jit.jit_fuser = torch.compile) run eager on a CUDA-less torch (ours):
  inductor compiles C++ for each in every fresh rank process, which costs a CPU run more than the tiny models gain;
  on a GPU they stay compiled. Importing this module before megatron.core (every module of ours that imports
  Megatron does) makes torch.compile, when Megatron's own modules call it, return the function itself: the
  decorator then loads neither dynamo nor inductor (each rank's import is the cheaper: results/LOG.md, 2026-12-07).
  Where Megatron was imported first, its functions are compiled wrappers and init_cpu sets the process's stance to
  eager (nothing else here compiles on CPU in a process that built a Megatron model: `bench engine --hf-compile`
  runs in its own).
- `RMSNorm`: the local stand-in for TENorm(RMSNorm) in cluster/mcore.py's local specs, because megatron-core's own
  WrappedTorchNorm refuses zero-centred gamma (Qwen3.5's norms).
"""
import contextlib
import sys

import torch

_CPU_READY = False
_torch_compile = torch.compile


def _compile_outside_megatron(model=None, **kw):
    """torch.compile for every caller but Megatron's modules, which get the function (or module) back as it is."""
    if sys._getframe(1).f_globals.get("__name__", "").startswith("megatron."):
        return model if model is not None else (lambda fn: fn)
    return _torch_compile(**kw) if model is None else _torch_compile(model, **kw)


if not torch.cuda.is_available() and "megatron.core.jit" not in sys.modules:
    torch.compile = _compile_outside_megatron


class _NoCudaRngTracker:
    """Stands in for CudaRNGStatesTracker on CPU: fork() is a no-op (dropout is 0 in the tiny model)."""

    def fork(self, name=None):
        return contextlib.nullcontext()

    def add(self, name, seed):
        pass

    def reset(self):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass


def init_cpu():
    """One-process group (gloo; nccl on CUDA) + Megatron parallel state (all sizes 1) unless the trainer set them, the
    process-wide CPU shims (torch.compile eager included), and Megatron's torch gated delta rule wherever
    flash-linear-attention is missing."""
    global _CPU_READY
    if _CPU_READY:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 without TE: name never bound
        moe_utils.te_general_gemm = None
    from megatron.core.ssm import gated_delta_net as gdn
    if not gdn.HAVE_FLA:  # GDN without flash-linear-attention (triton; on a GPU node without it: slower, same numbers):
        gdn.HAVE_FLA = True  # GatedDeltaNet.__init__ raises ImportError on this flag alone
        gdn.l2norm = _l2norm  # fla.modules.l2norm
        gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule  # Megatron's own torch reference kernel
    mrandom._CUDA_RNG_STATE_TRACKER = _NoCudaRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # the backward of TP / SP layers asks for it outside any block
        from megatron.core import jit
        if jit.jit_fuser is not _compile_outside_megatron:  # Megatron imported before this module: compiled wrappers
            torch.compiler.set_stance("force_eager")  # ... that run eager from here on
    if not dist.is_initialized():  # no port to collide on; nccl for CUDA tensors (a one-GPU trainer)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    _CPU_READY = True


def _l2norm(x, dim=-1, eps=1e-6):
    """fla's l2norm on CPU (as transformers' Qwen3.5 reference): x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


@contextlib.contextmanager
def cpu_shims():
    """torch.cuda.current_device -> "cpu" inside the block (rotary embedding, router weight moves)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


class RMSNorm(torch.nn.Module):
    """Local stand-in for TENorm(RMSNorm) honouring `layernorm_zero_centered_gamma` (y = x / rms(x) * (1 + w)),
    which megatron-core's own WrappedTorchNorm refuses; computed in fp32 as TE and transformers do."""

    def __init__(self, config, hidden_size, eps=1e-6, **unused):
        super().__init__()
        self.zero_centered, self.eps = config.layernorm_zero_centered_gamma, eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        # as TENorm: under sequence parallel each TP rank's grad is partial; finalize_model_grads all-reduces it
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + 1 if self.zero_centered else self.weight.float()
        return (y * w).type_as(x)
