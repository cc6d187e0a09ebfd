"""Tensor parallelism: one gpu worker's model sharded over N rank processes.

- `group.py`: the torch.distributed process group (gloo on the CPU, NCCL on CUDA), its
  collectives and the local rank processes rank 0 starts;
- `shard.py`: which slice of every checkpoint tensor a rank loads, and the refusals;
- `layers.py`: the row-parallel all-reduce, the vocab-parallel embedding and head;
- `runner.py`: rank 0's runner, which broadcasts each forward's inputs, and the other
  ranks' loop that runs them in lockstep.
"""
