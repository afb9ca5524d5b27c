"""The argument layer and the error boundary of every gpt2core command.

Typed argument checkers. Each checker is one object with two faces:

    ap.add_argument("--seed", type=cli.non_negative_int)      # argparse: "argument --seed: must be an integer
                                                               #  >= 0, got '-1'" (exit 2)
    seed = cli.non_negative_int.check(seed, "seed")           # Python: ArgError("seed must be an integer >= 0,
                                                               #  got -1"), a ValueError naming the argument

so a value is checked the same way whether it arrives as a flag or as a function argument (TrainConfig, GPT2Config,
GPT2.step, GPT2.generate). A dataclass field names its checker in its metadata (`metadata={"check": cli.port}`):
`check_fields(obj)` validates every such field, and a parser built from the fields uses the checker as `type=`.
New checkers: `Int(lo, hi)`, `Float(lo, hi, lo_open=, hi_open=, float32=)`, `Path(kind)`.

The entry wrapper. Every console script is `entry(prog, main)`: `main(argv)` runs, and what it raises becomes

    exit 0   success
    exit 1   a failure: the package's own errors (errors.Error: unreadable files, a locked folder, a diverged
             run...) and OSErrors (read-only, full disk, is-a-directory...) as ONE line naming the path and cause
    exit 2   a usage error: a bad argument (ArgError / argparse), one line naming the flag; also a device this
             machine cannot run (no NVIDIA driver, a driver too old for the build, no such GPU)
    exit 75  preempted: stopped by SIGTERM/SIGINT after writing a checkpoint (resume with --resume auto)

A traceback is printed only with --debug, or for a real bug (an exception that is none of the above).
"""
from __future__ import annotations

import argparse
import errno as _errno
import math
import numbers
import os
import re
import sys
import traceback
from pathlib import Path as _P

from .errors import ArgError, DeviceUnavailable, Error, Preempted

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_PREEMPTED = 0, 1, 2, 75

EXIT_CODES_HELP = """exit status:
  0   success
  1   failure: one line naming the file or the cause (--debug adds the traceback)
  2   bad argument: one line naming the flag, or a device this machine cannot run (no driver, no such GPU)
  75  preempted: stopped by SIGTERM/SIGINT after writing a checkpoint (rerun with --resume auto)"""


# ---------------------------------------------------------------------------------------------------- checkers
class Check:
    """A typed argument: `parse(text)` turns a command-line string into the value (ValueError on bad text),
    `check(value, name)` validates a Python value (ArgError naming `name`), and calling the object is argparse's
    `type=` (argparse then names the flag)."""

    what = "a value"

    def parse(self, text: str):
        return text

    def valid(self, value) -> str | None:
        """None if `value` is acceptable, else why not (the message's tail)."""
        return None

    def convert(self, value):
        """A Python value in the checker's type (e.g. a numpy integer as int); ValueError/TypeError if it is not
        of the type."""
        return value

    def check(self, value, name: str):
        try:
            v = self.convert(value)
        except (TypeError, ValueError, OverflowError):
            raise ArgError(f"{name} must be {self.what}, got {value!r}") from None
        why = self.valid(v)
        if why is not None:
            raise ArgError(f"{name} must be {self.what}, got {value!r}" + (f" ({why})" if why else ""))
        return v

    def __call__(self, text: str):
        try:
            v = self.parse(text)
        except (TypeError, ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"must be {self.what}, got {text!r}") from None
        why = self.valid(v)
        if why is not None:
            raise argparse.ArgumentTypeError(f"must be {self.what}, got {text!r}" + (f" ({why})" if why else ""))
        return v

    def parser(self):
        """An argparse `type=` that only parses (the text into the checker's type), leaving the range to a later
        check(value, name): for dataclass-backed commands whose validation, with its messages, is the
        dataclass's own."""
        def parse(text: str):
            try:
                return self.parse(text)
            except (TypeError, ValueError, OverflowError):
                raise argparse.ArgumentTypeError(f"must be {self.what}, got {text!r}") from None
        parse.__name__ = self.what
        return parse

    @property
    def __name__(self) -> str:  # argparse's fallback "invalid <name> value" and its error paths read this
        return self.what

    def __repr__(self) -> str:
        return f"<check: {self.what}>"


class Int(Check):
    """An integer in [lo, hi] (None: unbounded). On the command line also 1e8-style notation when it is a whole
    number ("--shard-size 1e8"); never a bool or a float in Python."""

    def __init__(self, lo: int | None = None, hi: int | None = None, what: str | None = None):
        self.lo, self.hi = lo, hi
        self.what = what or _int_what(lo, hi)

    def parse(self, text: str) -> int:
        text = text.strip()
        try:
            return int(text, 10)
        except ValueError:
            f = float(text)  # ValueError for words; inf/nan fail below
            if not math.isfinite(f) or f != int(f):
                raise ValueError(text) from None
            return int(f)

    def convert(self, value) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(value)
        return int(value)

    def valid(self, v: int) -> str | None:
        if self.lo is not None and v < self.lo:
            return ""
        if self.hi is not None and v > self.hi:
            return f"the most is {self.hi:,}"
        return None


def _int_what(lo, hi) -> str:
    if lo is not None and hi is not None and lo not in (0, 1):
        return f"an integer in [{lo}, {hi}]"
    if lo == 1:
        return "a positive integer"
    if lo is not None:
        return f"an integer >= {lo}"
    if hi is not None:
        return f"an integer <= {hi}"
    return "an integer"


_F32_MAX = 3.4028234663852886e38
_F32_TINY = 1.1754943508222875e-38  # the smallest normal float32


class Float(Check):
    """A finite real number in the interval from lo to hi (open ends with lo_open / hi_open; None: unbounded).
    float32=True: the value is used in float32 arithmetic (the optimizer's hyper-parameters, the loss scale), so it
    must also survive the rounding: not overflow to inf, not flush a non-zero value to 0 (or a denormal), and
    stay inside the interval after rounding (beta2 = 0.999999999 rounds to 1.0 in float32)."""

    def __init__(self, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 hi_open: bool = False, float32: bool = False, what: str | None = None):
        self.lo, self.hi, self.lo_open, self.hi_open, self.float32 = lo, hi, lo_open, hi_open, float32
        self.what = what or _float_what(lo, hi, lo_open, hi_open, float32)

    def parse(self, text: str) -> float:
        return float(text.strip())

    def convert(self, value) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(value)
        return float(value)

    def _in(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return True

    def valid(self, v: float) -> str | None:
        if not math.isfinite(v) or not self._in(v):
            return ""
        if self.float32:
            if abs(v) > _F32_MAX:
                return "it overflows to inf in float32"
            if v != 0 and abs(v) < _F32_TINY:
                return "it underflows to 0 or a denormal in float32"
            import numpy as np
            r = float(np.float32(v))
            if not self._in(r):
                return f"it rounds to {r!r} in float32"
        return None


def _float_what(lo, hi, lo_open, hi_open, float32) -> str:
    f32 = " representable in float32" if float32 else ""
    if lo is not None and hi is not None:
        return f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}{f32}"
    if lo is not None:
        return f"a finite number {'>' if lo_open else '>='} {lo:g}{f32}"
    if hi is not None:
        return f"a finite number {'<' if hi_open else '<='} {hi:g}{f32}"
    return "a finite number" + f32


class Choice(Check):
    """One of a fixed set of strings."""

    def __init__(self, *choices: str):
        self.choices = choices
        self.what = "one of " + ", ".join(repr(c) for c in choices)

    def convert(self, value):
        if not isinstance(value, str):
            raise TypeError(value)
        return value

    def valid(self, v) -> str | None:
        return None if v in self.choices else ""


class Device(Check):
    """A device spec: 'cpu', 'cuda' or 'cuda:N' (N >= 0). Syntax only: whether that GPU exists is
    check_device_available's question (it needs the core)."""

    what = "a device: 'cpu', 'cuda' or 'cuda:N'"
    _RE = re.compile(r"cpu|cuda(:(0|[1-9][0-9]{0,3}))?")

    def convert(self, value):
        if not isinstance(value, str):
            raise TypeError(value)
        return value

    def valid(self, v: str) -> str | None:
        return None if self._RE.fullmatch(v) else ""


class Path(Check):
    """A path of a kind: 'file' (an existing regular file, readable), 'dir' (an existing directory), 'path' (exists:
    either), 'out_dir' (a directory to write into: an existing directory, or a name whose nearest existing parent
    is a directory; never a regular file), 'out_file' (a file to write: not a directory, in a directory that exists
    or can be made). Returns the string (what the commands pass on)."""

    _WHAT = {"file": "an existing file", "dir": "an existing directory", "path": "an existing file or directory",
             "out_dir": "a directory to write into", "out_file": "a file to write"}

    def __init__(self, kind: str):
        if kind not in self._WHAT:
            raise ValueError(f"Path kind must be one of {', '.join(self._WHAT)}, got {kind!r}")
        self.kind = kind
        self.what = self._WHAT[kind]

    def convert(self, value):
        if isinstance(value, _P):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise TypeError(value)
        return value

    def valid(self, v: str) -> str | None:
        if not v or "\0" in v:
            return "an empty name" if not v else "a NUL byte in the name"
        p, kind = _P(v), self.kind
        try:
            if kind == "file":
                if p.is_dir():
                    return "it is a directory"
                if not p.exists():
                    return "no such file"
                if not os.access(p, os.R_OK):
                    return "not readable: permission denied"
            elif kind == "dir":
                if not p.exists():
                    return "no such directory"
                if not p.is_dir():
                    return "it is a file, not a directory"
            elif kind == "path":
                if not p.exists():
                    return "no such file or directory"
            elif kind == "out_dir":
                if p.exists() and not p.is_dir():
                    return "it exists and is not a directory"
                parent = _existing_parent(p)
                if parent is not None and not parent.is_dir():
                    return f"{parent} is not a directory"
            elif kind == "out_file":
                if p.is_dir():
                    return "it is a directory"
                parent = _existing_parent(p.parent if str(p.parent) else _P("."))
                if parent is not None and not parent.is_dir():
                    return f"{parent} is not a directory"
        except OSError as e:  # ENAMETOOLONG, ELOOP...
            return e.strerror or str(e)
        return None


def _existing_parent(p: _P) -> _P | None:
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            return q
    return None


class Port(Int):
    """A TCP port, 1..65535; with auto=True also 'auto' (and 0): pick a free one."""

    def __init__(self, auto: bool = False):
        super().__init__(1, 65535, "a TCP port in [1, 65535]" + (" or 'auto'" if auto else ""))
        self.auto = auto

    def parse(self, text: str):
        if self.auto and text.strip() in ("auto", "0"):
            return "auto"
        return super().parse(text)

    def convert(self, value):
        if self.auto and value in ("auto", 0):
            return "auto"
        return super().convert(value)

    def valid(self, v) -> str | None:
        return None if v == "auto" else super().valid(v)


class Optional(Check):
    """`inner` or None ('none' on the command line)."""

    def __init__(self, inner: Check):
        self.inner = inner
        self.what = inner.what

    def parse(self, text: str):
        return None if text.strip().lower() == "none" else self.inner.parse(text)

    def convert(self, value):
        return None if value is None else self.inner.convert(value)

    def valid(self, v) -> str | None:
        return None if v is None else self.inner.valid(v)


class AutoOr(Check):
    """'auto' or `inner` (e.g. --batch-size auto | 16)."""

    def __init__(self, inner: Check):
        self.inner = inner
        self.what = f"auto or {inner.what}"

    def parse(self, text: str):
        return "auto" if text.strip().lower() == "auto" else self.inner.parse(text)

    def convert(self, value):
        return "auto" if value == "auto" else self.inner.convert(value)

    def valid(self, v) -> str | None:
        return None if v == "auto" else self.inner.valid(v)


# the common ones
positive_int = Int(1)
non_negative_int = Int(0)
seed = Int(0, 2**63 - 1)
positive_float = Float(0, lo_open=True)
non_negative_float = Float(0)
fraction = Float(0, 1)                       # [0, 1]
open_fraction = Float(0, 1, lo_open=True, hi_open=True)   # (0, 1): a split that leaves something on both sides
seconds = Float(0, lo_open=True, what="a finite number of seconds > 0")
existing_file = Path("file")
existing_dir = Path("dir")
existing_path = Path("path")
output_dir = Path("out_dir")
output_file = Path("out_file")
device = Device()
port = Port()
port_or_auto = Port(auto=True)
# the optimizer's hyper-parameters, used in float32 by the core
lr = Float(0, float32=True)
weight_decay = Float(0, float32=True)
beta = Float(0, 1, hi_open=True, float32=True)
eps = Float(0, lo_open=True, float32=True)
grad_clip = Float(0, float32=True, what="a finite number >= 0 representable in float32 (0: no clipping)")


def threads(value, name: str = "threads") -> int:
    """A positive thread count that the machine has cores for (more threads than cores only slows OpenMP down)."""
    n = positive_int.check(value, name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n > cores:
        raise ArgError(f"{name} {n} is more than the {cores} CPU cores this process may use")
    return n


def field_check(f, checks: dict | None = None) -> Check | None:
    """The checker of dataclass field `f`: its metadata's "check", else checks[f.name], else None."""
    return f.metadata.get("check") or (checks or {}).get(f.name)


def check_fields(obj, prefix: str = "--", checks: dict | None = None) -> None:
    """Validate every dataclass field of `obj` that has a checker (field_check), raising ArgError that names the
    flag (prefix + the field name with dashes; prefix "" names the field as it is). A None value of a field whose
    default is None is "not set" and passes."""
    import dataclasses
    for f in dataclasses.fields(obj):
        chk = field_check(f, checks)
        if chk is None:
            continue
        v = getattr(obj, f.name)
        if v is None and f.default is None:
            continue
        chk.check(v, prefix + f.name.replace("_", "-") if prefix else f.name)


def check_device_available(spec: str, name: str = "--device") -> str:
    """`spec` is a device this machine can run: the syntax, then for CUDA that the backend is compiled, a GPU is
    found and the index exists. ArgError for a malformed spec, errors.DeviceUnavailable for a well-formed one this
    machine lacks (both usage errors: exit 2)."""
    device.check(spec, name)
    if spec == "cpu":
        return spec
    from . import _C
    from .errors import DeviceUnavailable
    from . import _libs, _plugins
    try:  # this build's CUDA module or the installed plugin's (gpt2core-cuda12 / gpt2core-cuda13)
        backend = _plugins.find()
    except _plugins.PluginError as e:
        raise DeviceUnavailable(f"{name} {spec}: {e}") from None
    if backend is None:
        raise DeviceUnavailable(f"{name} {spec}: {_plugins.why_none()}; use --device cpu")
    why = _libs.driver_problem() or _C.cuda_status()  # the driver first, in the words GPT2(device=) and the doctor use
    if why:
        raise DeviceUnavailable(f"{name} {spec}: {why}; use --device cpu")
    index = int(spec.partition(":")[2] or 0)
    if not cuda_index_exists(index):
        n = sum(1 for i in range(index) if cuda_index_exists(i))
        raise DeviceUnavailable(f"{name} {spec}: no such GPU; this machine has {n}"
                                + (f" (cuda:0..cuda:{n - 1})" if n else ""))
    return spec


def cuda_index_exists(index: int) -> bool:
    """Whether CUDA device `index` exists (its compute capability can be read)."""
    from . import _C
    try:
        return _C.cuda_capability(int(index)) > 0
    except Exception:  # the CUDA plugin's error for an invalid device ordinal  # noqa: BLE001
        return False


# ---------------------------------------------------------------------------------------------------- parsers
class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the exit codes in its help (the epilog) and a --debug switch; its subparsers
    are the same kind. A flag is taken only as written: no prefix of a longer flag (argparse's allow_abbrev), so
    a flag that does not exist (`--prompt`) is refused instead of read as another (`--prompts-file`)."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="print the Python traceback of a failure (for bug reports)")

    def format_help(self) -> str:  # the exit codes as a table, whatever the formatter does to the epilog
        return super().format_help().rstrip("\n") + "\n\n" + EXIT_CODES_HELP + "\n"

    _MINUS_VALUE = re.compile(r"-\.?[0-9]")

    def _parse_optional(self, arg_string):
        # A word that starts with a minus sign and a digit ("-5GiB", "-1e-3", "-.5") is a value, so that the flag
        # before it answers with its own message ("--gpu-memory must be a positive size, got '-5GiB'"); argparse
        # alone takes only plain negative numbers as values and says "expected one argument". No flag of gpt2core
        # starts with a digit.
        if self._MINUS_VALUE.match(arg_string) and not self._has_negative_number_optionals:
            return None
        return super()._parse_optional(arg_string)


# ---------------------------------------------------------------------------------------------------- errors
def describe_oserror(e: OSError) -> str:
    """One line naming the path(s) and the cause of an OSError: 'out/metrics.jsonl: No space left on device
    (ENOSPC)'. A WriteError's own message already says that."""
    from .errors import WriteError
    if isinstance(e, WriteError):
        return str(e)
    name = _errno.errorcode.get(e.errno, "") if e.errno else ""
    reason = (e.strerror or str(e) or type(e).__name__) + (f" ({name})" if name else "")
    paths = [os.fsdecode(p) for p in (e.filename, e.filename2) if p is not None]
    if paths:
        return f"{' -> '.join(paths)}: {reason}"
    return reason


def classify(e: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) for an expected failure, None for a bug."""
    if isinstance(e, Preempted):
        return EXIT_PREEMPTED, str(e)
    if isinstance(e, ArgError):
        return EXIT_USAGE, f"error: {e}"
    if isinstance(e, DeviceUnavailable) or type(e).__name__ == "DeviceError":
        # the command asked for a device this machine cannot run (no driver, a driver too old for the build, no
        # such GPU): a usage error, answered with what to use instead
        return EXIT_USAGE, f"error: {e}"
    if isinstance(e, OSError):
        return EXIT_FAILURE, describe_oserror(e)
    if isinstance(e, (Error, FloatingPointError)):
        return EXIT_FAILURE, str(e)
    if isinstance(e, MemoryError):
        return EXIT_FAILURE, f"out of memory{': ' + str(e) if str(e) else ''}"
    return None


def reraise_as_exit(prog: str, e: BaseException) -> None:
    """For a main() that Python callers also use: an expected failure `e` becomes SystemExit ("prog: message",
    status 1; or the status alone, after printing the line, for usage errors and preemption); returns for a bug
    (the caller re-raises it)."""
    if isinstance(e, (SystemExit, KeyboardInterrupt)):
        return
    known = classify(e)
    if known is None:
        return
    code, msg = known
    if code == EXIT_FAILURE:
        raise SystemExit(f"{prog}: {_one_line(msg)}") from e
    line = f"{prog}: {_one_line(msg)}"
    print(line, file=sys.stderr, flush=True)
    exc = SystemExit(line)  # str(exc) is the message for Python callers; the status is `code`
    exc.code = code
    raise exc from e


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split("\n")).strip()


def entry(prog: str, main):
    """The console script of command `prog` running `main(argv)`: returns the exit status (see the module's
    docstring) instead of letting an expected failure end in a traceback. `main` may return an int (the status),
    anything else counts as success."""

    def console(argv=None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse (2), or a main that exits itself
            if debug and e.__cause__ is not None:
                traceback.print_exception(type(e.__cause__), e.__cause__, e.__cause__.__traceback__)
            code = e.code
            if code is None or isinstance(code, int):
                return code or 0
            print(_one_line(code), file=sys.stderr, flush=True)
            return EXIT_FAILURE
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
            return 128 + 2
        except BrokenPipeError:  # `gpt2core-generate ... | head`: the reader left; nothing to report
            _silence_stdout()
            return EXIT_FAILURE
        except BaseException as e:  # noqa: B902 - the boundary
            known = classify(e)
            if known is None:
                traceback.print_exc()
                print(f"{prog}: internal error ({type(e).__name__}: {_one_line(e)}); this is a bug in gpt2core, "
                      "please report it with the traceback above", file=sys.stderr, flush=True)
                return EXIT_FAILURE
            if debug:
                traceback.print_exc()
            code, msg = known
            print(f"{prog}: {_one_line(msg)}", file=sys.stderr, flush=True)
            return code
        if isinstance(rc, bool) or not isinstance(rc, int):
            return EXIT_OK
        return rc

    console.__name__ = console.__qualname__ = "console"
    console.__doc__ = f"The console script `{prog}`: main(argv) behind the error boundary (gpt2core.cli.entry)."
    return console


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


__all__ = ["Check", "Int", "Float", "Choice", "Device", "Path", "Port", "Optional", "ArgumentParser", "entry",
           "classify", "describe_oserror", "check_fields", "check_device_available", "threads", "positive_int",
           "non_negative_int", "seed", "positive_float", "non_negative_float", "fraction", "open_fraction",
           "seconds", "existing_file", "existing_dir", "existing_path", "output_dir", "output_file", "device",
           "port", "port_or_auto", "lr", "weight_decay", "beta", "eps", "grad_clip", "EXIT_OK", "EXIT_FAILURE",
           "EXIT_USAGE", "EXIT_PREEMPTED", "EXIT_CODES_HELP"]
