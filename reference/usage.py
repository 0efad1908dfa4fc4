"""What a command line checks of its options before any work: each is an
argparse ``type``, so that a bad value is a usage error naming its option
(docs/design.md, bad input), raised while parsing, before anything runs.

    ap.add_argument("--heads", type=usage.count, default=4)
    #   error: argument --heads: expected an int of at least 1, got '-1'
    ap.add_argument("--link-gbs", type=usage.rate, default=25.0)
    #   error: argument --link-gbs: expected a number above 0, got '0'
    ap.add_argument("--plot", type=usage.output_file, default="loss.png")
    #   error: argument --plot: the folder /no/such does not exist
"""

import argparse
import math
import re
from pathlib import Path


def at_least(low):
    """An argparse type: an int of at least `low`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an int of at least {low}, got {text!r}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


count = at_least(1)             # sizes, devices, heads, repeats, threads
natural = at_least(0)           # seeds, counts that may be 0


def _number(text, fits, wanted):
    """float(text) if it is finite and `fits`, else the argparse error saying `wanted`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and fits(value)):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return value


def rate(text):
    """An argparse type: a finite number above 0 (a bandwidth, a compute rate, memory, a step size)."""
    return _number(text, lambda x: x > 0, "a number above 0")


def seconds(text):
    """An argparse type: a finite number of seconds, 0 or more."""
    return _number(text, lambda x: x >= 0, "a number of seconds, 0 or more")


def microseconds(text):
    """An argparse type: a finite number of microseconds, 0 or more (a latency)."""
    return _number(text, lambda x: x >= 0, "a number of microseconds, 0 or more")


def output_problem(option, path):
    """A message if `path` (an output file of `option`) cannot be written, or None."""
    problem = _unwritable(path)
    return problem and f"{option} {path}: {problem}"


def output_file(text):
    """An argparse type: a file this command will write ('' for none)."""
    problem = _unwritable(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _unwritable(path):
    """Why `path` cannot be written as a file (its folder missing, or a folder itself), or None."""
    if path is None or path == "":
        return None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        return f"the folder {folder} does not exist"
    if Path(path).is_dir():
        return "is a folder; give a file name"
    return None


def output_folder(text):
    """An argparse type: a folder this command writes into, made if missing (not a file)."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return text


def option_words(message, names):
    """The library's `message` with its argument names written as the options
    that set them (``n_devices`` -> ``--n-devices``), for a usage error."""
    for name in names:
        message = re.sub(rf"(?<![\w-]){name}(?!\w)", "--" + name.replace("_", "-"), message)
    return message


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default appended to its help once: not where the help
    says it already, nor where there is none to say (None, a flag's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)
