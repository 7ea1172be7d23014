"""What a model's arguments may hold: the type of every field and the range of every count, checked by
``ModelArgs.check`` and ``EncoderArgs.check`` before anything is built from them.

Model files come from strangers. A count read from one sizes loops (one module and one tensor name per layer),
tables (RoPE's cos/sin, positions) and caches, so a string, a zero or a billion there must stop at the check, as
one line naming the field, not as a traceback or a process that grows until it is killed. The ceilings are far
above any model of the supported families (126 layers, 262,144 tokens of vocabulary, a context of about a
million positions) and far below what would take a machine down before the memory budget (``models.memory``)
is even priced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

from scalenlp.errors import UserError

MAX_LAYERS = 2048
MAX_HEADS = 1 << 14
MAX_WIDTH = 1 << 20  # model width, MLP width, head size
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 22
MAX_LABELS = 1 << 16  # classes of a classification head

# Field -> (least, most) for the counts of ModelArgs and EncoderArgs; fields not named here are 0 or more.
RANGES = {"vocab_size": (1, MAX_VOCAB), "dim": (1, MAX_WIDTH), "n_layers": (1, MAX_LAYERS),
          "n_heads": (1, MAX_HEADS), "n_kv_heads": (1, MAX_HEADS), "ffn_dim": (1, MAX_WIDTH),
          "max_seq_len": (1, MAX_POSITIONS), "fixed_head_dim": (0, MAX_WIDTH), "sliding_window": (0, MAX_POSITIONS),
          "type_vocab_size": (0, MAX_VOCAB), "position_offset": (0, MAX_POSITIONS), "pad_token_id": (0, MAX_VOCAB),
          "num_labels": (1, MAX_LABELS)}


class FieldError(ValueError):
    """A field of model arguments that cannot be built; ``field`` names it, for readers that call it otherwise."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_count(field: str, value, shown: str | None = None) -> int:
    """``value`` as a count within ``field``'s range (``RANGES``); ``shown`` is how the message names it."""
    name = shown or field
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field, f"{name}={value!r} must be a whole number")
    least, most = RANGES.get(field, (0, math.inf))
    if value < least:
        raise FieldError(field, f"{name}={value} must be at least {least}")
    if value > most:
        raise FieldError(field, f"{name}={value:,} is more than {most:,}, beyond any model this loads")
    return value


def _check_number(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError(field, f"{field}={value!r} must be a finite number")
    if value < 0:
        raise FieldError(field, f"{field}={value} must not be negative")


def check_fields(args) -> None:
    """Every field of a ``ModelArgs`` / ``EncoderArgs`` of its declared type (ints whole, floats finite and not
    negative, tuples of numbers, lists of strings) and every count in its range; FieldError names the first not."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.type == "int":
            check_count(f.name, value)
        elif f.type == "float":
            _check_number(f.name, value)
        elif f.type in ("bool", "str") and type(value).__name__ != f.type:
            raise FieldError(f.name, f"{f.name}={value!r} must be a {'true/false' if f.type == 'bool' else 'string'}")
        elif f.type == "tuple":
            for item in value:
                _check_number(f.name, item)
        elif f.type == "list[str]" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise FieldError(f.name, f"{f.name}={value!r} must be a list of strings")


def check_counts(config: dict, keys: dict[str, str]) -> None:
    """The counts a model file gives under ``keys`` (its name -> the field it sets), each that is present and
    not null, checked as ``check_count`` checks the field and named as the file names it; a reader calls it
    before computing anything from them (a width divided by a head count, a list as long as the layers)."""
    for key, field in keys.items():
        if config.get(key) is not None:
            check_count(field, config[key], key)


@contextlib.contextmanager
def read_from(where: str) -> Iterator[None]:
    """Model arguments built from a file's values inside the block: what its values can make go wrong (a key it
    lacks, a value of the wrong type, a count out of range, a shape that cannot be built) is one UserError naming
    ``where`` (the file) and the key."""
    try:
        yield
    except KeyError as e:
        raise UserError(f"{where} lacks {e.args[0]}; it is not a complete model configuration") from None
    except (ValueError, TypeError, AttributeError, ArithmeticError) as e:
        raise UserError(f"{where}: {e}") from None
