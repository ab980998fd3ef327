# torch DDP over gloo, 2 processes on this machine: the same model, batch and thread count as `ddp two-rank`.
# Prints one JSON line (rank 0) with steps per second. Uses Debian's python3-torch (/usr/bin/python3).
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch_blas import blas_name


def run(rank, world, steps, warmup, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    n = 64 * world * (steps + warmup)
    x, y = torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)
    mine = torch.arange(rank, n, world)  # a DistributedSampler-style shard, gathered per batch as volt does
    for i in range(steps + warmup):
        if i == warmup:
            start = time.perf_counter()
        idx = mine[i * 64:(i + 1) * 64]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x.index_select(0, idx)), y.index_select(0, idx)).backward()
        opt.step()
    took = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"bench": "ddp_two_rank", "impl": "torch_ddp_gloo", "torch": torch.__version__,
                          "blas": blas_name(), "world_size": world, "batch_per_rank": 64, "steps": steps,
                          "steps_per_s": steps / took}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    mp.spawn(run, args=(2, steps, 20, 29000 + os.getpid() % 1000), nprocs=2)
