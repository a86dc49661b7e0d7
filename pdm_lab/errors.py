"""The one error type for bad input, and the checks that raise it.

Every check names the tensor and the first offending position, so a user can find the bad row
in a batch of a million tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor


class PDMInputError(ValueError):
    """Bad input to a pdm_lab function: names the argument and the first offending position."""


class UserInputError(Exception):
    """Marker base of the errors that are about what the user gave or has (a config value, a results
    folder, a locked directory, a plugin): the command line maps them to exit status 2. Defined
    here, below everything, so that ``is_input_error`` imports no module that imports this one."""


def first_position(bad: Tensor) -> tuple[int, ...]:
    """Index tuple of the first True entry of a boolean tensor (row-major)."""
    flat = int(torch.nonzero(bad.reshape(-1), as_tuple=False)[0, 0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), bad.shape))


def raise_at(name: str, bad: Tensor, what: str, values: Tensor | None = None) -> None:
    """Raise `PDMInputError` if any entry of `bad` is True, naming the first one."""
    if bad.numel() == 0 or not bool(bad.any()):
        return
    pos = first_position(bad)
    count = int(bad.sum())
    shown = f" (value {values[pos].item()!r})" if values is not None else ""
    raise PDMInputError(f"{name}: {what} at position {list(pos)}{shown}; {count} such entries")


def check_tensor(name: str, x: Tensor, *, ndim: int | None = None, floating: bool | None = None,
                 integer: bool = False) -> None:
    """Type, rank and dtype-kind checks at a public boundary."""
    if not isinstance(x, Tensor):
        raise PDMInputError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise PDMInputError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise PDMInputError(f"{name}: expected a floating dtype, got {x.dtype}")
    if integer and (x.is_floating_point() or x.dtype == torch.bool or x.is_complex()):
        raise PDMInputError(f"{name}: expected an integer dtype, got {x.dtype}")


def check_same(names: tuple[str, str], a: Tensor, b: Tensor, *, dims: tuple[int, ...] | None = None,
               dtype: bool = False) -> None:
    """Shape (optionally only some dims), device and optionally dtype agreement of two tensors."""
    sa = tuple(a.shape) if dims is None else tuple(a.shape[d] for d in dims)
    sb = tuple(b.shape) if dims is None else tuple(b.shape[d] for d in dims)
    if sa != sb:
        raise PDMInputError(f"{names[0]} has shape {tuple(a.shape)} but {names[1]} has shape "
                            f"{tuple(b.shape)}")
    if a.device != b.device:
        raise PDMInputError(f"{names[0]} is on {a.device} but {names[1]} is on {b.device}")
    if dtype and a.dtype != b.dtype:
        raise PDMInputError(f"{names[0]} has dtype {a.dtype} but {names[1]} has dtype {b.dtype}")


def check_zero_one(name: str, x: Tensor) -> None:
    """A mask given as numbers holds only 0 and 1 (bool always does): 0.5 is neither keep nor
    drop, and NaN is no answer at all."""
    if x.dtype == torch.bool or x.numel() == 0:
        return
    raise_at(name, (x != 0) & (x != 1), "not 0 or 1", x)  # NaN fails both compares


def check_not_nan(name: str, x: Tensor) -> None:
    """No NaN anywhere in `x` (±inf may be a true value; NaN never is)."""
    if x.is_floating_point():
        raise_at(name, torch.isnan(x), "NaN")


def logp_tolerance(dtype: torch.dtype) -> float:
    """How far above 0 a log-probability (or log-mass) may round: a few ulps of the dtype."""
    return 64 * torch.finfo(dtype).eps


def check_logp(name: str, logp: Tensor, *, allow_neg_inf: bool = True) -> None:
    """Log-probabilities: no NaN, no +inf, not above 0 beyond rounding; −inf only if allowed."""
    tol = logp_tolerance(logp.dtype)
    ok = logp <= tol  # one pass on the happy path: NaN and +inf both fail it
    if not allow_neg_inf:
        ok &= logp > float("-inf")
    if bool(ok.all()):
        return
    raise_at(name, torch.isnan(logp), "NaN log-probability")
    raise_at(name, logp == float("inf"), "+inf log-probability")
    if not allow_neg_inf:  # a legal −inf elsewhere must not hide the real fault below
        raise_at(name, logp == float("-inf"), "-inf log-probability (zero probability) not allowed")
    raise_at(name, logp > tol, "log-probability above 0", logp)


def one_line(err: BaseException, limit: int = 400) -> str:
    """An exception as one line for a command line: its message with newlines folded (a YAML
    error names the file, line and column over three lines), prefixed by the type when the
    message alone would not say what went wrong."""
    text = " ".join(part.strip() for part in str(err).splitlines() if part.strip())
    if isinstance(err, KeyError) and text.startswith(("'", '"')):
        text = f"missing key {text}"
    if not text or isinstance(err, (ImportError, EOFError)) and type(err).__name__ not in text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


#: Exit status of an internal error (sysexits.h's EX_SOFTWARE): a pdm_lab bug, told apart from
#: bad input (2) so that a bug never reads as the user's mistake.
INTERNAL_ERROR = 70


def is_input_error(err: BaseException) -> bool:
    """Whether `err` is about what the user gave or has (exit status 2): a config or option value
    (``ConfigError``), a YAML file, a results folder, a locked directory, a plugin, a file or
    directory (``OSError``), a module that is not installed. Anything else, a plain ``ValueError``
    or ``KeyError`` from deep inside included, is an internal error."""
    import yaml

    return isinstance(err, (UserInputError, yaml.YAMLError, OSError, ImportError))


def exit_code(err: BaseException) -> int:
    """2 for bad input (``is_input_error``), ``INTERNAL_ERROR`` otherwise."""
    return 2 if is_input_error(err) else INTERNAL_ERROR
