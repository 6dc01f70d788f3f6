"""vllm.distributed.parallel_state: the globals and functions vllm-omni's diffusion
parallel_state reads and sets. vllm-omni builds its own diffusion groups on torch.distributed;
vllm's coordinators (``init_model_parallel_group``) are needed only for expert parallelism,
which the tests do not run."""
import torch.distributed

_TP = None
_DP = None
_PP = None
_EP = None
_PCP = None


class GroupCoordinator:  # pragma: no cover - a type name only
    pass


def init_distributed_environment(world_size=-1, rank=-1, distributed_init_method="env://",
                                 local_rank=-1, backend="gloo", **kwargs):
    """vllm-omni initialises torch.distributed itself before calling this; vllm's own world
    group is not used by the diffusion attention."""
    assert torch.distributed.is_initialized()


def init_model_parallel_group(*args, **kwargs):  # pragma: no cover - expert parallelism only
    raise NotImplementedError("vllm stub: init_model_parallel_group (expert parallelism)")


def destroy_distributed_environment():
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
