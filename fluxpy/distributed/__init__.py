"""Data-parallel training over several processes: the launcher's environment, a TCP rendezvous, the launcher
(``python -m fluxpy.distributed.run``) and gradient bucketing. The NCCL communicator comes later (through
``fluxpy.kernels``); nothing here touches a device.

>>> from fluxpy.distributed import read_env
>>> read_env({}).shard
(0, 1)
"""
from .buckets import DEFAULT_CAP_BYTES, Bucket, bucket_plan
from .env import DistributedEnv, DistributedEnvError, read_env
from .rendezvous import Group, RendezvousError, free_port, rendezvous

__all__ = ["DEFAULT_CAP_BYTES", "Bucket", "bucket_plan", "DistributedEnv", "DistributedEnvError", "read_env",
           "Group", "RendezvousError", "free_port", "rendezvous"]
