"""Synchronized training statistics on GPUs over NCCL against nn.SyncBatchNorm: accuracy and time.

Launch one process per GPU with torchrun (on a machine without network, --standalone):

    torchrun --standalone --nproc_per_node 2 scripts/dist_check.py --out DIR

Dry run on the CPU with gloo (nn.SyncBatchNorm refuses CPU tensors, so the reference is a
float64 run of the unfused pattern on the concatenated batch, in every process):

    torchrun --standalone --nproc_per_node 2 scripts/dist_check.py --device cpu --small --out DIR

Cases: the seed problem (B=16 per rank, Ci=64, Co=128, D,H,W=16,32,32, k=5, scale 2.0,
float32) and unequal batches (B=16 on even ranks, 7 on odd ones). For each:

- accuracy: the fused module with ``process_group`` (float32) and the reference pattern
  built with nn.SyncBatchNorm, in float64 (the truth) and float32 (TF32 off), make one
  training call and one eval call on the same per-rank inputs, from the same state; relerr
  ``||a - b|| / ||b||`` of each rank's outputs and of the running statistics after the
  training call, and whether the running statistics are bit-identical across ranks;
- timing of the training-mode call: the fused module with and without synchronization,
  nn.SyncBatchNorm's eager pattern (float32, PyTorch's default TF32 flags), and the
  all-gather alone; CUDA events, 5 warm-up calls, then the median (and min, max) of 25
  calls, each started after a barrier. Reported per rank.

Rank 0 writes DIR/dist_check.json and prints a table. NVLink multicast (NVLS) stays off:
NCCL_NVLS_ENABLE=0 is set before NCCL starts unless the environment sets it. The script
imports the installed fused_ops: the editable install of the source tree
(``pip install --no-build-isolation -e .``), or PYTHONPATH=. in a tree built in place.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402  (after the NCCL environment)
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import fused_ops  # noqa: E402

SEED_PROBLEM = dict(ci=64, co=128, size=(16, 32, 32), k=5, scale=2.0)
SMALL_PROBLEM = dict(ci=8, co=16, size=(6, 8, 8), k=3, scale=2.0)
WARMUP, REPS = 5, 25


class Pattern(nn.Module):
    """The unfused pattern, as tests/conftest.py's Reference."""

    def __init__(self, ci, co, k, scale):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(ci, co, k)
        self.scale_factor = scale
        self.batch_norm = nn.BatchNorm3d(co)
        self.global_avg_pool = nn.AdaptiveAvgPool3d((1, 1, 1))

    def forward(self, x):
        return self.global_avg_pool(self.batch_norm(self.conv_transpose(x) * self.scale_factor))


def base_pattern(problem):
    """The same parameters and non-trivial BN state on every rank."""
    torch.manual_seed(0)
    p = Pattern(problem["ci"], problem["co"], problem["k"], problem["scale"])
    with torch.no_grad():
        p.batch_norm.weight.uniform_(0.5, 1.5)
        p.batch_norm.bias.normal_()
        p.batch_norm.running_mean.normal_()
        p.batch_norm.running_var.uniform_(0.5, 2.0)
    return p


def rank_input(problem, batches, rank, step, device):
    """Rank `rank`'s input of one step: rows of the concatenated batch (seeded)."""
    g = torch.Generator().manual_seed(1000 * step + 7)
    x = torch.randn(sum(batches), problem["ci"], *problem["size"], generator=g)
    return x.split(batches)[rank].to(device)


def relerr(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def fused_module(pattern, device, process_group):
    m = fused_ops.ConvTransposeBNPool3d.from_modules(
        copy.deepcopy(pattern.conv_transpose), pattern.scale_factor,
        copy.deepcopy(pattern.batch_norm), process_group=process_group)
    return m.to(device)


def references(pattern, device):
    """(name, module, dtype, whole_batch) of the references run on this device."""
    if device.type == "cuda":
        return [(name, nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(pattern))
                 .to(device, dtype), dtype, False)
                for name, dtype in (("syncbn_f64", torch.float64), ("syncbn_f32", torch.float32))]
    # nn.SyncBatchNorm refuses CPU tensors: every rank runs the float64 pattern on the
    # concatenated batch instead and keeps its own rows.
    return [("concat_f64", copy.deepcopy(pattern).double(), torch.float64, True)]


def run_reference(module, dtype, whole_batch, problem, batches, rank, step, x):
    if not whole_batch:
        return module(x.to(dtype))
    full = torch.cat([rank_input(problem, batches, r, step, x.device)
                      for r in range(len(batches))])
    lo = sum(batches[:rank])
    return module(full.to(dtype))[lo:lo + batches[rank]]


def check_accuracy(problem, batches, device):
    """relerr of the fused module against each reference, per output and running stat."""
    rank = dist.get_rank()
    pattern = base_pattern(problem)
    fused = fused_module(pattern, device, dist.group.WORLD)
    refs = references(pattern, device)
    result = {name: {} for name, *_ in refs}
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        for step, mode in enumerate(["train", "eval"]):
            x = rank_input(problem, batches, rank, step, device)
            fused.train(mode == "train")
            out = fused(x)
            for name, module, dtype, whole in refs:
                module.train(mode == "train")
                ref = run_reference(module, dtype, whole, problem, batches, rank, step, x)
                result[name][f"out_{mode}"] = relerr(out, ref)
                if mode == "train":
                    for stat in ("running_mean", "running_var"):
                        result[name][stat] = relerr(getattr(fused.batch_norm, stat),
                                                    getattr(module.batch_norm, stat))
            if mode == "train":
                state = [fused.batch_norm.running_mean.cpu(), fused.batch_norm.running_var.cpu()]
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    result["running_stats_identical_across_ranks"] = all(
        torch.equal(a, b) for s in everyone for a, b in zip(s, everyone[0]))
    return result


class Timer:
    """Milliseconds of one call: CUDA events on GPUs, the wall clock on the CPU."""

    def __init__(self, device):
        self.device = device

    def __call__(self, fn):
        barrier(self.device)  # every rank starts the call together
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def barrier(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def summarize(times):
    return dict(median=statistics.median(times), min=min(times), max=max(times), n=len(times))


def time_calls(problem, batches, device):
    """Timing of the training-mode call and of the all-gather alone on this rank."""
    rank = dist.get_rank()
    pattern = base_pattern(problem)
    x = rank_input(problem, batches, rank, 0, device)
    calls = {
        "fused_sync": fused_module(pattern, device, dist.group.WORLD).train(),
        "fused_local": fused_module(pattern, device, None).train(),
    }
    if device.type == "cuda":
        calls["syncbn_eager_f32"] = nn.SyncBatchNorm.convert_sync_batchnorm(
            copy.deepcopy(pattern)).to(device).train()
    stats = torch.zeros(3, problem["co"], dtype=torch.float64, device=device)
    timer, result = Timer(device), {}
    with torch.no_grad():
        for name, module in calls.items():
            result[name] = measure(timer, lambda module=module: module(x))
        result["all_gather_alone"] = measure(
            timer, lambda: fused_ops.distributed.all_gather_stats(stats, dist.group.WORLD))
    return result


def measure(timer, fn):
    for _ in range(WARMUP):
        timer(fn)
    return summarize([timer(fn) for _ in range(REPS)])


def gather_to_rank0(obj):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def print_table(report):
    print(f"\n{report['device']} x {report['world_size']}, torch {report['torch']}, "
          f"backend {report['backend']}")
    for case in report["cases"]:
        print(f"\n== {case['name']}: batches {case['batches']} ==")
        print(f"{'rank':>4} {'reference':<12} {'out train':>10} {'out eval':>10} "
              f"{'run mean':>10} {'run var':>10}")
        for rank, acc in enumerate(case["accuracy"]):
            for name, e in acc.items():
                if isinstance(e, dict):
                    print(f"{rank:>4} {name:<12} {e['out_train']:10.2e} {e['out_eval']:10.2e} "
                          f"{e['running_mean']:10.2e} {e['running_var']:10.2e}")
        print("running stats bit-identical across ranks:",
              all(acc["running_stats_identical_across_ranks"] for acc in case["accuracy"]))
        print(f"{'rank':>4} {'training call (ms)':<20} {'median':>9} {'min':>9} {'max':>9}")
        for rank, timing in enumerate(case["timing_ms"]):
            for name, t in timing.items():
                print(f"{rank:>4} {name:<20} {t['median']:9.3f} {t['min']:9.3f} {t['max']:9.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for dist_check.json")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="a small problem (dry runs)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g. torchrun --standalone --nproc_per_node 2 "
                 "scripts/dist_check.py --out DIR")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    problem = SMALL_PROBLEM if args.small else SEED_PROBLEM
    big, small = (4, 3) if args.small else (16, 7)
    world = dist.get_world_size()
    cases = [("seed", [big] * world), ("unequal", [big if r % 2 == 0 else small
                                                   for r in range(world)])]
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        world_size=world, backend=dist.get_backend(), torch=torch.__version__,
        fused_ops_build=fused_ops.build_info(), problem=problem,
        nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO")},
        warmup=WARMUP, reps=REPS, cases=[])
    try:
        for name, batches in cases:
            accuracy = gather_to_rank0(check_accuracy(problem, batches, device))
            timing = gather_to_rank0(time_calls(problem, batches, device))
            report["cases"].append(dict(name=name, batches=batches, accuracy=accuracy,
                                        timing_ms=timing))
        if dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "dist_check.json"), "w") as f:
                json.dump(report, f, indent=1)
            print_table(report)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
