"""Plants plausible bugs in a copy of the tree, one at a time, and reports which the CPU tests catch.

    python scripts/mutation_check.py [--full] [--only NAME ...] [--timeout S] [--list]
                                     [--cpp-build DIR]

The tree's files (tracked, and untracked ones git does not ignore) and the built extension
(fused_ops/_C*.so) are copied into a temporary directory; each mutant replaces one snippet of
one file there (the snippet must occur exactly once), runs its tests with `-x` (--full: the
whole suite) and is put back. The tests import the copy (tests/conftest.py puts the tree they
live in first on sys.path). A mutant is *caught* when a test fails (or errors), *survived* when
they all pass; a snippet that no longer occurs is *stale* (the code moved: update the list).

Tests that already fail on the unmutated copy (a build older than the tests, say) are run once
first and deselected for the mutants, and listed.

C++ mutants (file under csrc/) need a rebuild: --cpp-build DIR names a tree built in place
with FUSED_OPS_FORCE_CPU=1 (`python setup.py build_ext --inplace`) whose csrc/ the snippets
match; each C++ mutant is planted there, rebuilt (ninja recompiles what includes the file),
its _C*.so copied into the copy of the tree, and the file restored and rebuilt at the end.
Without --cpp-build they are listed as skipped.

Exit status 1 if a mutant survived or is stale.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Mutant:
    name: str
    file: str  # the file it is planted in, from the tree's root
    old: object  # the snippet, or a tuple of alternatives (code that changed), with
    new: object  # the replacement of each
    why: str  # the bug it stands for
    tests: tuple  # the test files that should catch it


MUTANTS = [
    # --- fused_ops/modules.py: the batch norm's arguments ---------------------------------------
    Mutant("momentum_0_as_none", "fused_ops/modules.py",
           "if bn.momentum is None:", "if not bn.momentum:",
           "momentum=0.0 taken for None: a cumulative average instead of frozen statistics",
           ("tests/test_statistics.py", "tests/test_fusion.py")),
    Mutant("eval_uses_batch_stats", "fused_ops/modules.py",
           "use_batch_stats = training or (bn.running_mean is None and bn.running_var is None)",
           "use_batch_stats = True",
           "eval mode normalizes with the batch statistics (and updates the running ones)",
           ("tests/test_eval.py", "tests/test_module.py")),
    Mutant("eval_batch_stats_when_untracked", "fused_ops/modules.py",
           "use_batch_stats = training or (bn.running_mean is None and bn.running_var is None)",
           "use_batch_stats = training or not bn.track_running_stats",
           "eval with track_running_stats=False but the buffers kept uses batch statistics "
           "(nn.BatchNorm3d uses the buffers)",
           ("tests/test_statistics.py",)),
    Mutant("train_updates_untracked_buffers", "fused_ops/modules.py",
           "track = not training or bn.track_running_stats", "track = True",
           "training with track_running_stats=False writes the buffers it still has",
           ("tests/test_statistics.py",)),
    Mutant("module_ignores_bn_eps", "fused_ops/modules.py",
           "use_batch_stats, factor, float(bn.eps),", "use_batch_stats, factor, 1e-5,",
           "the module passes the default eps, not its batch norm's",
           ("tests/test_dispatch.py", "tests/test_eval.py")),
    Mutant("bias_dropped_in_training", "fused_ops/modules.py",
           "x, weight, bias, float(scale), bn.weight, bn.bias,",
           "x, weight, None if training else bias, float(scale), bn.weight, bn.bias,",
           "the conv bias left out in training, where it cancels in the output (but not in "
           "running_mean)",
           ("tests/test_statistics.py", "tests/test_module.py")),
    Mutant("batches_counted_for_momentum_none_only", "fused_ops/modules.py",
           "    if counting:\n        bn.num_batches_tracked.add_(1)",
           "    if counting and bn.momentum is None:\n        bn.num_batches_tracked.add_(1)",
           "num_batches_tracked counted only where the factor needs it",
           ("tests/test_module.py", "tests/test_statistics.py")),
    # --- fused_ops/fusion.py --------------------------------------------------------------------
    Mutant("fuse_div_as_mul", "fused_ops/fusion.py",
           'return 1.0 / divisor, a, f"{spelling} {b!r}"',
           'return divisor, a, f"{spelling} {b!r}"',
           "fuse takes x / c as x * c", ("tests/test_fusion.py",)),
    Mutant("fuse_add_sub_as_mul", "fused_ops/fusion.py",
           '("call_function", f): "mul" for f in (operator.mul, torch.mul, torch.multiply)}',
           '("call_function", f): "mul" for f in (operator.mul, torch.mul, torch.multiply, '
           'operator.add, operator.sub)}',
           "fuse takes x + c and x - c for a scale", ("tests/test_fusion.py",)),
    Mutant("fuse_abs_scale", "fused_ops/fusion.py",
           'return float(factor), other, f"{spelling} {factor!r}"',
           'return abs(float(factor)), other, f"{spelling} {factor!r}"',
           "fuse drops the scale's sign", ("tests/test_fusion.py",)),
    Mutant("fuse_negation_dropped", "fused_ops/fusion.py",
           "return -1.0, node.args[0], spelling", "return 1.0, node.args[0], spelling",
           "fuse takes -y for y", ("tests/test_fusion.py",)),
    Mutant("fused_chain_uses_its_own_mode", "fused_ops/fusion.py",
           "batch_norm.training, algo=self.algo, **self.conv_options)",
           "self.training, algo=self.algo, **self.conv_options)",
           "a fused chain follows the model's mode, not its batch norm's (a frozen batch norm)",
           ("tests/test_fusion.py",)),
    Mutant("fuse_any_pool_size", "fused_ops/fusion.py",
           "if not (size == 1 or (isinstance(size, (tuple, list)) and tuple(size) == (1, 1, 1))):",
           "if False:", "fuse accepts a pool that is not global", ("tests/test_fusion.py",)),
    Mutant("module_follows_its_own_mode", "fused_ops/modules.py",
           "return ct_bn_pool_by_module(x, conv.weight, conv.bias, scale, bn, bn.training,",
           "return ct_bn_pool_by_module(x, conv.weight, conv.bias, scale, bn, True,",
           "ConvTransposeBNPool3d in training mode whatever its batch norm's mode",
           ("tests/test_module.py",)),
    # --- fused_ops/_autograd.py: the backward -------------------------------------------------
    Mutant("backward_unbiased_variance", "fused_ops/_autograd.py",
           "dim=(0, 2, 3, 4), correction=0,", "dim=(0, 2, 3, 4), correction=1,",
           "training's backward normalizes with the unbiased variance", ("tests/test_gradients.py",)),
    Mutant("backward_train_eps_dropped", "fused_ops/_autograd.py",
           "torch.rsqrt(var * ctx.scale ** 2 + ctx.eps)", "torch.rsqrt(var * ctx.scale ** 2)",
           "training's backward without eps", ("tests/test_gradients.py",)),
    Mutant("backward_eval_eps_dropped", "fused_ops/_autograd.py",
           "torch.rsqrt(running_var.to(compute) + ctx.eps)", "torch.rsqrt(running_var.to(compute))",
           "eval's backward without eps", ("tests/test_gradients.py",)),
    Mutant("backward_eval_ignores_conv_bias", "fused_ops/_autograd.py",
           "shift = -mean if bias is None else bias.to(compute) * ctx.scale - mean",
           "shift = -mean", "eval's gamma gradient without the conv bias",
           ("tests/test_gradients.py",)),
    Mutant("backward_scale_sign", "fused_ops/_autograd.py",
           "return ctx.scale * torch.rsqrt(", "return abs(ctx.scale) * torch.rsqrt(",
           "training's backward drops the scale's sign", ("tests/test_gradients.py",)),
    Mutant("backward_eval_scale_sign", "fused_ops/_autograd.py",
           "coef = gain * (ctx.scale / positions)", "coef = gain * (abs(ctx.scale) / positions)",
           "eval's backward drops the scale's sign", ("tests/test_gradients.py",)),
    Mutant("eval_backward_mask_past_the_crop", "fused_ops/_box_sums.py",
           "(at < out_size[d])", "(at <= out_size[d])",
           "eval's backward counts taps that land one position past the cropped output",
           ("tests/test_gradients.py",)),
    Mutant("synced_backward_local_sums", "fused_ops/_autograd.py",
           "sums = all_reduce(sums)", "sums = sums",
           "the synchronized backward uses this process's sums, not the group's",
           ("tests/test_distributed.py",)),
    Mutant("backward_not_centred_over_batch", "fused_ops/_autograd.py",
           "(coef * (g - means[0]))", "(coef * g)",
           "training's backward forgets the batch mean's dependence on each sample",
           ("tests/test_gradients.py",)),
    Mutant("backward_eval_bias_without_scale", "fused_ops/_autograd.py",
           '"bias": g_sum * gain * ctx.scale}', '"bias": g_sum * gain}',
           "eval's conv-bias gradient without the scale", ("tests/test_gradients.py",)),
    Mutant("backward_eval_reads_live_buffers", "fused_ops/_autograd.py",
           "eval_stats = tuple(None if stat is None else stat.clone()",
           "eval_stats = tuple(None if stat is None else stat",
           "eval's backward reads the running statistics as they are at backward time",
           ("tests/test_gradients.py",)),
    # --- fused_ops/_fake.py, functional.py, distributed.py -------------------------------------
    Mutant("fake_ignores_groups", "fused_ops/_fake.py",
           "    channels = weight.size(1) * groups", "    channels = weight.size(1)",
           "the fake kernel's output channels without groups",
           ("tests/test_compile_export.py", "tests/test_opcheck.py")),
    Mutant("functional_swaps_dilation_and_output_padding", "fused_ops/functional.py",
           'output_padding=_triple(output_padding, "output_padding"),\n'
           '                dilation=_triple(dilation, "dilation")',
           'output_padding=_triple(dilation, "dilation"),\n'
           '                dilation=_triple(output_padding, "output_padding")',
           "two conv options passed in each other's place",
           ("tests/test_module.py", "tests/test_eval.py")),
    Mutant("merge_drops_the_between_batch_term", "fused_ops/distributed.py",
           "spread = m2.sum(0) + (count * delta * delta).sum(0)", "spread = m2.sum(0)",
           "synchronized statistics without the spread of the processes' means",
           ("tests/test_distributed.py",)),
    # --- C++ host code (needs --cpp-build): the finalize shared by both devices ----------------
    Mutant("cpp_running_var_biased", "csrc/sums/finalize.h",
           "m * var_z * count / (count - 1)", "m * var_z",
           "running_var updated with the biased variance", ("tests/test_statistics.py",)),
    Mutant("cpp_eps_dropped", "csrc/sums/finalize.h",
           "1.0 / sqrt(var_z + a.eps)", "1.0 / sqrt(var_z)",
           "the finalize normalizes without eps", ("tests/test_statistics.py", "tests/test_eval.py")),
    Mutant("cpp_running_mean_without_bias", "csrc/sums/finalize.h",
           ("m * (z_mu + a.scale * bias)", "m * a.scale * (mu + bias)"),
           ("m * z_mu", "m * a.scale * mu"),
           "running_mean without the conv bias", ("tests/test_statistics.py",)),
]


def tree_files():
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout.decode()
    files = [name for name in listed.split("\0") if name and (REPO / name).is_file()]
    return files + [str(p.relative_to(REPO)) for p in (REPO / "fused_ops").glob("_C*.so")]


def copy_tree(dest):
    for name in tree_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    if not list((dest / "fused_ops").glob("_C*.so")):
        sys.exit("mutation_check: fused_ops/_C*.so is missing: build the extension in place first")


def pytest(tree, tests, timeout, deselect=(), first_failure=True):
    """(exit status or "timeout", output) of the tests run in `tree`."""
    command = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-rfE",
               "--tb=line", *(["-x"] if first_failure else [])]
    for node in deselect:
        command += ["--deselect", node]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    return run.returncode, run.stdout + run.stderr


def failed_nodes(output):
    return re.findall(r"^(?:FAILED|ERROR) (\S+?)(?: - .*)?$", output, flags=re.M)


def rebuild(build_dir):
    env = {**os.environ, "FUSED_OPS_FORCE_CPU": "1"}
    run = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=build_dir,
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"rebuild failed in {build_dir}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")


def plant(path, mutant):
    """Replaces the mutant's snippet (the first alternative found exactly once); the file's
    text before, or None where no alternative is."""
    text = path.read_text()
    olds = mutant.old if isinstance(mutant.old, tuple) else (mutant.old,)
    news = mutant.new if isinstance(mutant.new, tuple) else (mutant.new,)
    for old, new in zip(olds, news):
        if text.count(old) == 1:
            path.write_text(text.replace(old, new))
            return text
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="run the whole suite for each mutant")
    parser.add_argument("--only", nargs="*", default=None, help="mutant names")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant's tests")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--cpp-build", type=Path, default=None,
                        help="a tree built in place (FUSED_OPS_FORCE_CPU=1) for the C++ mutants")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if args.only is None or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:45s} {m.file:26s} {m.why}")
        return 0

    results = []
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        check = subprocess.run([sys.executable, "-c", "import fused_ops; print(fused_ops.__file__)"],
                               cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                               capture_output=True, text=True)
        assert check.stdout.strip().startswith(str(tree)), ("the copy does not import its own "
                                                            f"fused_ops: {check.stdout}{check.stderr}")
        suite = ["tests"]
        selected = sorted({t for m in mutants for t in m.tests})
        print(f"baseline: {'the suite' if args.full else ' '.join(selected)} on the unmutated copy",
              flush=True)
        status, output = pytest(tree, suite if args.full else selected, None, first_failure=False)
        baseline = failed_nodes(output)
        if status not in (0, 1):
            print(output[-3000:])
            sys.exit(f"mutation_check: the baseline run ended with status {status}")
        if baseline:
            print(f"{len(baseline)} tests fail without a mutant, deselected below:")
            for node in baseline:
                print(f"  {node}")

        for m in mutants:
            started = time.time()
            cpp = m.file.startswith("csrc/")  # (every alternative is under csrc/)
            if cpp and args.cpp_build is None:
                results.append((m, "skipped", "C++: needs --cpp-build", 0.0))
                continue
            root = args.cpp_build if cpp else tree
            source = root / m.file
            if not source.is_file():
                results.append((m, "stale", f"{m.file} not found", 0.0))
                continue
            original = plant(source, m)
            if original is None:
                results.append((m, "stale", "snippet not found exactly once", 0.0))
                continue
            so_backup = None
            try:
                if cpp:
                    rebuild(args.cpp_build)
                    so_backup = {p.name: p.read_bytes() for p in (tree / "fused_ops").glob("_C*.so")}
                    for so in args.cpp_build.joinpath("fused_ops").glob("_C*.so"):
                        shutil.copy2(so, tree / "fused_ops" / so.name)
                status, output = pytest(tree, suite if args.full else list(m.tests), args.timeout,
                                        baseline)
            finally:
                source.write_text(original)
                if so_backup is not None:
                    for name, data in so_backup.items():
                        (tree / "fused_ops" / name).write_bytes(data)
            failed = failed_nodes(output) if isinstance(status, int) else []
            if status == 0:
                verdict, detail = "survived", ""
            elif status == "timeout":
                verdict, detail = "timeout", f"after {args.timeout:.0f} s"
            elif status in (1, 2):
                verdict = "caught"
                detail = failed[0] if failed else output.strip().splitlines()[-1][:100]
            else:
                verdict, detail = "error", f"pytest exit status {status}"
            results.append((m, verdict, detail, time.time() - started))
            print(f"{m.name:45s} {verdict:9s} {detail}", flush=True)
        if args.cpp_build is not None and any(m.file.startswith("csrc/") for m in mutants):
            rebuild(args.cpp_build)  # the restored sources

    print()
    print(f"{'mutant':45s} {'verdict':9s} {'secs':>5s}  caught by / why")
    for m, verdict, detail, seconds in results:
        print(f"{m.name:45s} {verdict:9s} {seconds:5.0f}  {detail}")
        if verdict != "caught":
            print(f"{'':61s}({m.file}: {m.why})")
    counts = {v: sum(r[1] == v for r in results) for v in ("caught", "survived", "stale", "timeout",
                                                           "error", "skipped")}
    print(", ".join(f"{n} {v}" for v, n in counts.items() if n))
    return 1 if counts["survived"] or counts["stale"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
