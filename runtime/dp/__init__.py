"""The data-parallel axis on a rank: replicas and gradient averaging (``averaging``), gradient
buckets overlapped with backward (``buckets``) and ZeRO's sharded state (``zero``)."""
