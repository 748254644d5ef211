"""Weight synchronisation: learner rank 0 broadcasts named tensors to every generator worker.

`WeightSender` (learner rank 0) and `WeightReceiver` (each generator worker; inside vLLM it is
created by `cagrpo_ray.rollout.worker_extension`) share a dedicated group over its own
`TCPStore`: gloo on CPU, vLLM's PyNccl on GPU (`transport.py` says why not torch's NCCL process
group). The protocol is described in `sender.py`.
"""

from cagrpo_ray.sync.group import SyncAddress, WeightSyncError, as_sync_address
from cagrpo_ray.sync.receiver import WeightReceiver
from cagrpo_ray.sync.sender import SyncStats, WeightSender

__all__ = [
    "SyncAddress",
    "SyncStats",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "as_sync_address",
]
