"""`lowbit` command line. Each subcommand lives next to the code it drives: a module
that defines `register(parser)` (adds its arguments) and `run(args) -> int`.
The table below is the only place that lists them."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import signal
import sys
import threading

# name -> (module, one-line help)
COMMANDS = {
    "formats": ("lowbit.entrypoints.formats", "table of element formats computed from the codecs"),
    "demo": ("lowbit.entrypoints.demo", "quick tour: format table and per-tensor vs per-channel int8"),
    "check": ("lowbit.entrypoints.check", "verify a kernel's output stored in a safetensors file"),
    "audit": ("lowbit.entrypoints.audit", "conformance table of every linear kernel on this machine"),
    "probe": ("lowbit.entrypoints.probe", "measure this GPU's matrix-multiply accumulators (test vectors)"),
    "experiment": ("lowbit.entrypoints.experiment", "reference experiments as reproducible reports"),
    "bench": ("lowbit.entrypoints.bench", "GPU benchmarks of lowbit kernels against baselines"),
    "doctor": ("lowbit.entrypoints.doctor", "which formats run natively, emulated or on the CPU here"),
    "tune": ("lowbit.entrypoints.tune", "measure which kernel path each quantized layer takes on this GPU"),
    "quantize": ("lowbit.entrypoints.quantize", "quantize a model, evaluate it and write a checkpoint"),
    "sites": ("lowbit.entrypoints.sites", "per-site SQNR diagnosis of a model under a recipe"),
    "inspect": ("lowbit.entrypoints.inspect", "list a quantized checkpoint's schemes and flag problems"),
    "verify-model": ("lowbit.entrypoints.verify_model", "check a deployed checkpoint layer by layer against the "
                                                        "float64 reference"),
}

# Commands that run lowbit's Triton kernels as the thing they check: without a GPU those run in
# Triton's interpreter, which triton.jit and triton.language pick when first imported, so it is
# switched on before the command's module (and triton with it) is imported.
INTERPRET_ON_CPU = {"check", "audit"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowbit", description="low-precision quantization you can verify")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the chosen command's module: the others may pull heavy dependencies.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    chosen_parser = None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name == chosen:
            if name in INTERPRET_ON_CPU:
                _interpret_without_gpu()
            module = importlib.import_module(module_name)
            module.register(p)
            p.set_defaults(_run=module.run)
            chosen_parser = p
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        (chosen_parser or parser).error(_unknown_message(unknown, chosen_parser or parser))
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        with _sigterm_as_interrupt():
            return int(args._run(args) or 0)
    except Terminated:
        print(f"\nlowbit {args.command}: terminated (SIGTERM); an output being written was discarded", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        # Ctrl-C: files being written were staged and are discarded (lowbit.io.outdir)
        print(f"\nlowbit {args.command}: interrupted (Ctrl-C); an output being written was discarded", file=sys.stderr)
        return 130
    except (ValueError, OSError, NotImplementedError) as err:
        # bad input (a wrong argument, an unreadable or missing file, a scheme with no path): the
        # message names the argument and the fix; a traceback would only hide it
        print(f"lowbit {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if (err.name or "lowbit").split(".")[0] == "lowbit":
            raise  # lowbit's own module missing is a bug, not a setup step
        print(f"lowbit {args.command}: error: this needs the package {err.name!r}, which is not installed "
              f"(pip install {err.name}, or the [models] extra)", file=sys.stderr)
        return 2


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with "(default: X)" added only where it says something: not after a help
    text that already names its default, nor for a switch (False) or an unset option (None)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if ("default" in text.lower() or d is None or isinstance(d, bool) or d is argparse.SUPPRESS
                or (isinstance(d, (list, tuple, dict, str)) and not d)
                or not action.option_strings or action.help == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's or `kill`'s stop) raised where the process is, as Ctrl-C's
    KeyboardInterrupt is: every staged output (lowbit.io.outdir) is discarded on the way out."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Within the block, SIGTERM raises Terminated (only in the main thread, where signal
    handlers can be set; elsewhere the default, immediate exit, stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _unknown_message(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments", with the nearest flag of the command for each
    misspelt one (difflib)."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    parts = []
    for u in unknown:
        near = difflib.get_close_matches(u.split("=")[0], flags, n=1, cutoff=0.6) if u.startswith("-") else []
        parts.append(f"{u} (did you mean {near[0]}?)" if near else u)
    return "unrecognized arguments: " + " ".join(parts)


def _interpret_without_gpu() -> None:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _one_line(err: BaseException) -> str:
    """The error's message on one line (a JSON or OS message can carry newlines)."""
    return " ".join(str(err).split())


if __name__ == "__main__":
    sys.exit(main())
