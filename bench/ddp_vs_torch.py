# torch DDP over gloo, 2 processes: the same model, batch and thread count as `ddp two-rank`. Prints one JSON line
# (rank 0) with steps per second. Uses Debian's python3-torch (/usr/bin/python3).
#   ddp_vs_torch.py [STEPS]                                 both processes here (torch.multiprocessing)
#   ddp_vs_torch.py STEPS --rank R --world W --master A:P   one process, the rank R of a job whose rank 0 listens on
#                                                           A:P (bench/ddp_cluster.sh starts one on each host; set
#                                                           GLOO_SOCKET_IFNAME to the hosts' interface)
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch_blas import blas_name


def run(rank, world, steps, warmup, master):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)
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
    names = [None] * world  # the hosts the ranks ran on
    dist.all_gather_object(names, os.uname().nodename)
    if rank == 0:
        print(json.dumps({"bench": "ddp_two_rank", "impl": "torch_ddp_gloo", "torch": torch.__version__,
                          "blas": blas_name(), "world_size": world, "hosts": len(set(names)), "batch_per_rank": 64,
                          "steps": steps, "steps_per_s": steps / took}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = int(args[0]) if args and not args[0].startswith("--") else 150
    if "--rank" in args:
        option = lambda name: args[args.index(name) + 1]
        run(int(option("--rank")), int(option("--world")), steps, 20, option("--master"))
    else:
        mp.spawn(run, args=(2, steps, 20, f"127.0.0.1:{29000 + os.getpid() % 1000}"), nprocs=2)
