"""The multi-node recipe of docs/distributed.md, checked: run under ``torchrun`` (any number of
nodes and processes per node), it builds a (nodes x processes-per-node) mesh, data parallel over
the nodes and tensor parallel within each (``ColwiseParallel`` lm_head), takes one step of
``ak.linear_cross_entropy`` on it, and compares the loss and the head's gradient with the same
step in one process on the whole batch (every rank computes that too: the shapes are tiny).

Two agents on one machine (two terminals, or ``&``)::

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 127.0.0.1 \\
        --master-port 29511 bench/torchrun_check.py
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr 127.0.0.1 \\
        --master-port 29511 bench/torchrun_check.py

Rank 0 prints one line per check and exits 1 if any differs beyond float32 rounding.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import astrai_kernels as ak

VOCAB, HIDDEN, ROWS_PER_NODE, LENGTH = 1000, 64, 2, 16


def main():
    dist.init_process_group("gloo")
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = dist.get_world_size() // per_node
    mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # every rank builds the same head and the same whole batch
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(nodes * ROWS_PER_NODE, LENGTH, HIDDEN)
    target = torch.randint(0, VOCAB, (nodes * ROWS_PER_NODE, LENGTH))

    whole = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    whole.load_state_dict(head.state_dict())
    expected = ak.linear_cross_entropy(hidden, whole.weight, target)
    expected.backward()

    parallelize_module(head, mesh["tp"], ColwiseParallel(use_local_output=False))
    node = mesh.get_local_rank("dp")
    rows = slice(node * ROWS_PER_NODE, (node + 1) * ROWS_PER_NODE)
    loss = ak.linear_cross_entropy(hidden[rows], head.weight, target[rows])
    loss.backward()
    # data parallel over the nodes: the mean of the nodes' means (equal row counts) and of their
    # gradients, as DDP or FSDP would average them
    local_loss = loss.to_local().detach().clone()
    dist.all_reduce(local_loss, group=mesh.get_group("dp"))
    grad = head.weight.grad.to_local().clone()
    dist.all_reduce(grad, group=mesh.get_group("dp"))
    grad = torch.distributed.tensor.DTensor.from_local(
        grad / nodes, mesh["tp"], head.weight.grad.placements).full_tensor()
    checks = {"loss": (local_loss / nodes, expected.detach()),
              "lm_head.weight.grad": (grad, whole.weight.grad)}
    failed = False
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()} = {nodes} nodes x {per_node} processes, "
              f"mesh {tuple(mesh.shape)} (dp, tp), backend {ak.available_backends('cpu')[0]}")
    for name, (got, want) in checks.items():
        error = float((got - want).abs().max())
        # float32 rounding of sums over a few thousand terms, relative to the largest entry
        bound = 1e-5 * float(want.abs().max()) + 1e-6
        failed |= error > bound
        if dist.get_rank() == 0:
            print(f"{name}: max |distributed - one process| = {error:.3g} "
                  f"(bound {bound:.3g}) {'ok' if error <= bound else 'DIFFERS'}")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
