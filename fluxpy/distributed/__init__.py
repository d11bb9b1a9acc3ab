"""Data-parallel training over several processes, one GPU each, through NCCL.

``init()`` joins the job the launcher started (``python -m fluxpy.distributed.run --nproc N script.py``, or
torchrun, or Slurm) and returns its :class:`ProcessGroup`; :class:`DataParallel` wraps a model so that its gradients
are averaged over the ranks while the backward pass runs; ``DataLoader(..., shard=group.env.shard)`` gives each rank
its part of every epoch. Also here: the launcher's environment (:func:`read_env`), the TCP rendezvous, gradient
bucket plans, :class:`SyncBatchNorm`, and :func:`local_groups` (ranks as threads, for tests on the CPU).

>>> from fluxpy.distributed import read_env, init
>>> read_env({}).shard
(0, 1)
>>> init().is_main      # no launcher: a job of one process
True
"""
from .buckets import DEFAULT_CAP_BYTES, Bucket, bucket_plan
from .data_parallel import DataParallel, broadcast_arrays, check_structure, structure_digest
from .env import DistributedEnv, DistributedEnvError, read_env
from .group import DistributedError, ProcessGroup, destroy, get_group, init, is_initialized
from .local import local_groups
from .rendezvous import Group, RendezvousError, free_port, rendezvous
from .sync_batchnorm import SyncBatchNorm, all_reduce_sum, convert_sync_batchnorm

__all__ = ["DEFAULT_CAP_BYTES", "Bucket", "bucket_plan", "DistributedEnv", "DistributedEnvError", "read_env",
           "Group", "RendezvousError", "free_port", "rendezvous", "DataParallel", "broadcast_arrays",
           "check_structure", "structure_digest", "DistributedError", "ProcessGroup", "destroy", "get_group", "init",
           "is_initialized", "local_groups", "SyncBatchNorm", "all_reduce_sum", "convert_sync_batchnorm"]
