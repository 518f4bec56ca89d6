"""The ``torchfn`` command: ``doctor``, ``demo``, ``build-ops``, ``dp epsilon`` and ``data``
(``convert``, ``inspect``, ``verify``, ``stats``)."""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence


def _tool_version(cmd: Sequence[str]) -> str:
    """Return the first line a tool prints for its version, or why it could not be read."""
    exe = shutil.which(cmd[0])
    if exe is None:
        return "not found"
    try:
        out = subprocess.run(
            [exe, *cmd[1:]], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:  # pragma: no cover - environment-specific
        return f"found at {exe}, but running it failed: {e}"
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    if not lines:
        return f"found at {exe} (no version printed)"
    # nvcc prints its release on the last line; others on the first
    line = lines[-1] if cmd[0] == "nvcc" else lines[0]
    return f"{line.strip()} ({exe})"


def doctor_report(build_ops: bool = True) -> list[tuple[str, str]]:
    """Return ``(name, value)`` rows describing torch, devices, compilers and the custom ops.

    ``build_ops`` loads the custom ops (building them first if the cache has none) so that
    the report says what a call would really use.
    """
    import torch

    rows: list[tuple[str, str]] = []
    import torchfn

    rows.append(("torchfn", torchfn.__version__))
    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", platform.platform()))
    rows.append(("torch", torch.__version__))
    try:
        import torchopt

        rows.append(("torchopt", torchopt.__version__))
    except Exception as e:  # pragma: no cover - torchopt is a hard dependency
        rows.append(("torchopt", f"import failed: {e}"))
    rows.append(("torch CUDA build", str(torch.version.cuda) if torch.version.cuda else "none (CPU build)"))
    rows.append(("cpu threads", str(torch.get_num_threads())))
    # the float32 precision switches change both speed and numbers (torch's defaults: matmul
    # off, cuDNN on); torchfn.compile.inductor_options() picks conv layouts by the cuDNN one
    rows.append(("TF32", f"matmul {torch.backends.cuda.matmul.allow_tf32}, "
                         f"cuDNN {torch.backends.cudnn.allow_tf32}"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append(
                (
                    f"cuda:{i}",
                    f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, "
                    f"{p.multi_processor_count} SMs",
                )
            )
    else:
        why = "torch is a CPU build" if not torch.version.cuda else "no CUDA device visible"
        rows.append(("cuda devices", f"none ({why})"))
    rows.append(("usable devices", ", ".join(_usable_devices())))
    rows.append(("c++ compiler", _tool_version(["c++", "--version"])))
    rows.append(("ninja", _tool_version(["ninja", "--version"])))
    rows.append(("nvcc", _tool_version(["nvcc", "--version"])))
    rows.extend(_ops_rows(build_ops))
    return rows


def _usable_devices() -> list[str]:
    """Return the devices on which a small tensor op actually runs."""
    import torch

    devs = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            try:
                x = torch.ones(4, device=f"cuda:{i}")
                torch.cuda.synchronize(i)
                if float((x * 2).sum()) == 8.0:
                    devs.append(f"cuda:{i}")
            except Exception as e:  # pragma: no cover - GPU-specific
                devs.append(f"cuda:{i} (FAILED: {e})")
    return devs


def _ops_rows(build: bool = True) -> list[tuple[str, str]]:
    """Rows for the custom ops: built (or loaded from the cache) or falling back, and why.

    With ``build`` the kernels are loaded now (built first if the cache has none), so the
    report says what a real call would use; without it, only what this process knows.
    """
    from torchfn import ops

    rows: list[tuple[str, str]] = []
    try:
        if build:
            report = ops.build_ops()
            if report["ok"]:
                rows.append(("ops: kernels", f"{report['action']} in {report['seconds']:.1f} s "
                                              f"for {', '.join(report['devices'])} "
                                              f"({report['library']})"))
            else:
                rows.append(("ops: kernels", f"NOT built: {report['reason']}"))
        status = ops.ops_status()
    except Exception as e:  # report, never crash the doctor
        return [*rows, ("ops", f"status failed: {type(e).__name__}: {e}")]
    backend = status.get("backend", {})
    rows.append(("ops: backend", ", ".join(f"{d}={b}" for d, b in backend.items())))
    if status.get("reason"):
        rows.append(("ops: fallback reason", str(status["reason"])))
    if status.get("cuda_reason"):
        rows.append(("ops: no CUDA kernels", str(status["cuda_reason"])))
    rows.append(("ops: build cache", str(status.get("build_root"))))
    return rows


def _cmd_doctor(args: argparse.Namespace) -> int:
    rows = doctor_report(build_ops=not args.no_build)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from torchfn._demo import run_demo

    run_demo(steps=args.steps)
    return 0


def _cmd_build_ops(args: argparse.Namespace) -> int:
    from torchfn import ops

    report = ops.build_ops(verbose=args.verbose)
    for key in ("ok", "action", "devices", "seconds", "library", "reason", "cuda_reason",
                "build_root"):
        print(f"{key:<12} {report.get(key)}")
    if not report["ok"] and report.get("log"):
        print("--- compiler output (last 40 lines) ---")
        print("\n".join(str(report["log"]).splitlines()[-40:]))
    return 0 if report["ok"] else 1


def _cmd_dp_epsilon(args: argparse.Namespace) -> int:
    """Print the epsilon of ``steps`` Poisson-sampled Gaussian steps at ``delta``."""
    import math

    from torchfn.persample import RDPAccountant, pld_epsilon, prv_epsilon

    bad = []
    if not 0.0 <= args.q <= 1.0:
        bad.append(f"--q must be a sampling probability in [0, 1]; got {args.q}")
    if not (math.isfinite(args.sigma) and args.sigma >= 0.0):
        bad.append(f"--sigma must be a finite noise multiplier >= 0; got {args.sigma}")
    if args.steps < 0:
        bad.append(f"--steps must be >= 0; got {args.steps}")
    if not 0.0 < args.delta < 1.0:
        bad.append(f"--delta must be in the open interval (0, 1); got {args.delta}")
    if bad:
        for msg in bad:
            print(f"torchfn dp epsilon: error: {msg}", file=sys.stderr)
        return 2
    try:
        if args.accountant == "pld":
            eps = pld_epsilon(args.q, args.sigma, args.steps, args.delta)
        elif args.accountant == "prv":
            eps = prv_epsilon(args.q, args.sigma, args.steps, args.delta)
        else:
            acct = RDPAccountant()
            acct.step(noise_multiplier=args.sigma, sample_rate=args.q, steps=args.steps)
            eps = acct.get_epsilon(args.delta)
    except (ValueError, TypeError, ImportError) as e:
        print(f"torchfn dp epsilon: error: {e}", file=sys.stderr)
        return 2
    print(f"{eps:.6f}")
    return 0


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _label_line(counts: dict[int, int] | None) -> str:
    if counts is None:
        return "none"
    shown = ", ".join(f"{k}: {v}" for k, v in list(counts.items())[:20])
    more = f", ... ({len(counts)} classes)" if len(counts) > 20 else f" ({len(counts)} classes)"
    return shown + more


def _data_errors() -> tuple[type[BaseException], ...]:
    from torchfn.data import CorruptShardError, TarError

    return (ValueError, TypeError, OSError, ImportError, IndexError, TarError,
            CorruptShardError)


def _cmd_data_inspect(args: argparse.Namespace) -> int:
    from torchfn.data import inspect_source

    info = inspect_source(args.path, format=args.format, label=args.label)
    print(f"path      {info.path}")
    print(f"format    {info.format}")
    print(f"samples   {info.num_samples} in {info.num_units} units "
          f"({len(info.files)} files, {_bytes(info.total_bytes)})")
    print("fields    (sample 0)")
    for k, v in info.fields.items():
        print(f"  {k:<16} {v}")
    print(f"labels    {_label_line(info.label_counts)}")
    return 0


def _cmd_data_stats(args: argparse.Namespace) -> int:
    from torchfn.data import open_source, source_stats

    src = open_source(args.path, format=args.format, label=args.label)
    st = source_stats(src, progress=not args.no_progress)
    print(f"samples      {st.num_samples}")
    print(f"labels       {_label_line(st.label_counts)}")
    print("field bytes  (decoded, all samples)")
    for k, v in st.field_bytes.items():
        print(f"  {k:<16} {v} ({_bytes(v)})")
    print(f"sample bytes min {st.sample_bytes_min}, mean {st.sample_bytes_mean:.1f}, "
          f"max {st.sample_bytes_max}")
    return 0


def _cmd_data_verify(args: argparse.Namespace) -> int:
    from torchfn.data import CorruptShardError, TarError, verify_source

    try:
        report = verify_source(args.path, format=args.format, label=args.label)
    except (TarError, CorruptShardError) as e:  # too damaged to open
        print(f"CORRUPT {args.path}: {e}")
        return 1
    for gid, file, index, reason in report.bad:
        if index < 0:  # a file that could not be opened at all
            print(f"CORRUPT {file}: {reason}")
        else:
            print(f"CORRUPT {file} sample {index} (id {gid}): {reason}")
    if report.ok:
        print(f"ok: {report.num_samples} samples verified in {args.path}")
        return 0
    files = sum(1 for b in report.bad if b[2] < 0)
    print(f"{len(report.bad) - files} of {report.num_samples} samples corrupt"
          + (f", {files} files unreadable" if files else "") + f" in {args.path}")
    return 1


def _cmd_data_convert(args: argparse.Namespace) -> int:
    from torchfn.data import open_source, read_manifest, write_shards

    if args.samples_per_shard < 1:
        raise ValueError(f"--samples-per-shard must be >= 1; got {args.samples_per_shard}")
    src = open_source(args.src, format=args.format, label=args.label)
    if src.labels is None and args.default_label is None:
        raise ValueError(
            f"{src.describe()} has no labels and .tfs shards store one integer label per "
            "sample: name the labels with --label, or pass --default-label INT"
        )
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1; got {args.workers}")
    write_shards(src, args.dst, samples_per_shard=args.samples_per_shard,
                 default_label=args.default_label, progress=not args.no_progress,
                 num_workers=args.workers)
    shards = read_manifest(args.dst)["shards"]
    print(f"wrote {len(src)} samples from {src.describe()} as {len(shards)} .tfs shards "
          f"in {args.dst}")
    return 0


def _run_data(args: argparse.Namespace) -> int:
    try:
        return int(args.data_func(args))
    except _data_errors() as e:
        print(f"torchfn data {args.data_command}: error: {e}", file=sys.stderr)
        return 2


def _add_data_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="data tools: `torchfn data convert|inspect|verify|stats ...`")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    formats = ("auto", "tfs", "tar", "npy", "parquet", "hf")

    def common(q: argparse.ArgumentParser, path: str = "path") -> None:
        q.add_argument(path, help="a .tfs shard directory, .tar file/directory, .npy "
                                  "file/directory, .parquet file/directory or HF save_to_disk "
                                  "directory; a local path, glob or fsspec URL (memory://, s3://)")
        q.add_argument("--format", choices=formats, default="auto",
                       help="the source format (default: auto, from the path)")
        q.add_argument("--label", default=None,
                       help="the labels: tar member extension (default cls), .npy array name, "
                            "Parquet column, or HF column (default label)")

    q = data_sub.add_parser("convert", help="write any source as .tfs shards")
    common(q, "src")
    q.add_argument("dst", help="the .tfs shard directory to write")
    q.add_argument("--samples-per-shard", type=int, default=1024,
                   help="samples per .tfs shard (default: 1024)")
    q.add_argument("--default-label", type=int, default=None,
                   help="the label stored for every sample of a source without labels")
    q.add_argument("--workers", type=int, default=1,
                   help="processes converting contiguous runs of shards (default: 1); the "
                        "output is byte-identical for any count")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=_run_data, data_func=_cmd_data_convert)
    q = data_sub.add_parser("inspect", help="format, samples, fields, labels and sizes")
    common(q)
    q.set_defaults(func=_run_data, data_func=_cmd_data_inspect)
    q = data_sub.add_parser("verify", help="read every sample; exit 1 naming corrupt ones")
    common(q)
    q.set_defaults(func=_run_data, data_func=_cmd_data_verify)
    q = data_sub.add_parser("stats", help="class counts, bytes per field, sample sizes")
    common(q)
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=_run_data, data_func=_cmd_data_stats)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchfn`` console command."""
    parser = argparse.ArgumentParser(prog="torchfn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="print torch/CUDA/compiler versions, devices and custom-op status")
    p.add_argument("--no-build", action="store_true",
                   help="do not load/build the custom ops; report only what is known")
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser("demo", help="run the end-to-end demo of the functional core (CPU, < 2 min)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("build-ops", help="build the C++/CUDA custom ops now and report")
    p.add_argument("--verbose", action="store_true", help="show the compiler output")
    p.set_defaults(func=_cmd_build_ops)
    p = sub.add_parser("dp", help="differential privacy tools: `torchfn dp epsilon ...`")
    dp_sub = p.add_subparsers(dest="dp_command", required=True)
    p = dp_sub.add_parser(
        "epsilon",
        help="print the epsilon of DP-SGD (Poisson-sampled Gaussian steps) at a delta",
    )
    p.add_argument("--q", type=float, required=True,
                   help="sampling probability of each example per step, in [0, 1]")
    p.add_argument("--sigma", type=float, required=True,
                   help="noise multiplier (noise std / clipping norm), >= 0")
    p.add_argument("--steps", type=int, required=True, help="number of steps, >= 0")
    p.add_argument("--delta", type=float, required=True, help="target delta, in (0, 1)")
    p.add_argument("--accountant", choices=("rdp", "pld", "prv"), default="rdp",
                   help="rdp (default, no extra dependency), pld (tighter; needs "
                        'pip install "torchfn[accounting]") or prv (as tight as pld, no extra '
                        "dependency; prints the upper bound eps_upper)")
    p.set_defaults(func=_cmd_dp_epsilon)
    _add_data_commands(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
