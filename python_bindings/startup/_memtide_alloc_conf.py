"""memtide selected and configured through ``PYTORCH_CUDA_ALLOC_CONF``.

    PYTORCH_CUDA_ALLOC_CONF=backend:memtide,memtide_max_bytes:60GiB,garbage_collection_threshold:0.8

torch parses that variable (or its alias ``PYTORCH_ALLOC_CONF``) while ``import torch`` loads its
CUDA library; it accepts only ``native`` and ``cudaMallocAsync`` as backends and stops on a key it
does not know. So memtide takes its part out before torch looks, in two steps:

1. ``memtide_alloc_conf.pth`` (site-packages) calls :func:`strip_environ` as the interpreter
   starts, but only when one of the variables mentions memtide. It removes ``backend:memtide``
   and every ``memtide_<option>:<value>`` item, exports the options as ``MEMTIDE_<OPTION>`` (the
   names of memtide's options table) and leaves torch's own items in their order. ``import
   memtide`` before ``import torch`` does the same, for variables set inside the process.
2. torch calls :func:`torch_autoload` (a ``torch.backends`` entry point) at the end of ``import
   torch``, before CUDA is initialized. It checks the options (a bad key or value stops the
   import, naming the item) and, if ``backend:memtide`` was asked for, makes memtide torch's
   CUDA allocator.

Child processes inherit the rewritten variables, so they make the same choice. This module must
stay cheap and free of imports beyond ``os``: it runs in every interpreter start-up that names
memtide, and torch_autoload runs in every ``import torch`` in the environment.
"""

from __future__ import annotations

import os
from typing import Dict, List, MutableMapping, Tuple

CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
PREFIX = "memtide_"
#: "1" once a variable asked for backend:memtide; read by torch_autoload (and inherited).
SELECTED = "MEMTIDE_TORCH_ALLOCATOR"
#: "option=item;..." for the options that came from a variable, so errors can name the item.
ORIGIN = "MEMTIDE_ALLOC_CONF_ITEMS"
#: A problem strip_environ found; raised when torch (or memtide, torch being loaded) applies the items.
ERROR = "MEMTIDE_ALLOC_CONF_ERROR"


#: Set by memtide.apply_alloc_conf in this process: the items were acted on.
applied = False


def _unapplied_warning() -> None:
    """At exit: memtide's items were taken out of torch's variable, but nothing acted on them
    (torch's backend autoload was off and memtide was never imported). Said once, on stderr."""
    if applied:
        return
    import sys

    print("memtide: PYTORCH_CUDA_ALLOC_CONF named memtide, but nothing acted on it: "
          "TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps torch from loading memtide's hook, and memtide was not "
          "imported after torch; import memtide after torch (or unset TORCH_DEVICE_BACKEND_AUTOLOAD)", file=sys.stderr)


class AllocConfError(ValueError):
    """A memtide item in PYTORCH_CUDA_ALLOC_CONF that cannot be used."""


def env_name(option: str) -> str:
    """The variable memtide's options table reads `option` from: max_bytes -> MEMTIDE_MAX_BYTES."""
    return "MEMTIDE_" + option.upper()


def _is_memtide_pair(key: str, value: str) -> bool:
    key = key.strip().lower()
    return key.startswith(PREFIX) or (key == "backend" and value.strip().lower() == "memtide")


def is_memtide_item(item: str) -> bool:
    """True for backend:memtide and memtide_<option>:<value> items, in any letter case (torch's
    own keys are lower case; a `Backend:MEMTIDE` meant memtide and must not vanish), and for
    those written with '=' for ':' (see misspelt)."""
    key, _, value = item.partition(":")
    return _is_memtide_pair(key, value) or misspelt(item) is not None


def misspelt(item: str):
    """`backend=memtide` or `memtide_<option>=<value>`: the item as it should be written, else None.
    torch's parser aborts the interpreter on such an item (an assertion inside `import torch`), so
    memtide takes it out first and names it."""
    if ":" in item or "=" not in item:
        return None
    key, _, value = (part.strip() for part in item.partition("="))
    return f"{key}:{value}" if _is_memtide_pair(key, value) else None


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def same_value(a: str, b: str) -> bool:
    """Whether two spellings of an option value mean the same: 1GiB and 1073741824, True and 1.
    (The options table checks the value itself later; this only decides agreement.)"""
    a, b = a.strip().lower(), b.strip().lower()
    if a == b:
        return True
    if (a in _TRUE and b in _TRUE) or (a in _FALSE and b in _FALSE):
        return True

    def size(text: str):
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz ").strip()
        unit = text[len(digits):].strip()
        try:
            return float(digits) * _SIZE_UNITS[unit]
        except (ValueError, KeyError):
            return None

    sa, sb = size(a), size(b)
    return sa is not None and sa == sb


def split(var: str, text: str) -> Tuple[List[str], bool, Dict[str, Tuple[str, str]]]:
    """Splits one variable's value into (torch's items, backend:memtide asked, memtide options).

    memtide options map option -> (value, the item as written). Raises AllocConfError for a
    memtide item without a value, an option given twice, or memtide next to another backend.
    """
    kept: List[str] = []
    selected = False
    other_backend = None
    opts: Dict[str, Tuple[str, str]] = {}
    for item in filter(None, (raw.strip() for raw in text.split(","))):
        if not is_memtide_item(item):
            if item.partition(":")[0].strip() == "backend":
                other_backend = item
            kept.append(item)
            continue
        fixed = misspelt(item)
        if fixed is not None:
            raise AllocConfError(f"{var}: item {item!r} uses '=' where its items use ':'; write {fixed!r}")
        key, sep, value = (part.strip() for part in item.partition(":"))
        if key.lower() == "backend":
            selected = True
            continue
        option = key[len(PREFIX):].lower()
        if not sep or not value or not option:
            raise AllocConfError(f"{var}: item {item!r} needs the form memtide_<option>:<value>")
        if option in opts:
            raise AllocConfError(f"{var}: memtide_{option} is given twice ({opts[option][1]!r} and {item!r})")
        opts[option] = (value, item)
    if selected and other_backend is not None:
        raise AllocConfError(f"{var}: backend:memtide and {other_backend} both choose an allocator; keep one")
    if selected:
        # torch's own spelling of the one torch option memtide has too; it stays in torch's items
        # (torch accepts it), and memtide_expandable_segments, when given as well, wins.
        for item in kept:
            key, sep, value = (part.strip() for part in item.partition(":"))
            if key.lower() == "expandable_segments" and sep and value and "expandable_segments" not in opts:
                opts["expandable_segments"] = (value, item)
    return kept, selected, opts


def strip_environ(environ: MutableMapping[str, str] = os.environ) -> None:
    """Moves memtide's items out of the PYTORCH_*ALLOC_CONF variables of `environ`.

    Never raises (it runs inside site.py): a problem is stored in MEMTIDE_ALLOC_CONF_ERROR, to be
    raised where torch or memtide loads, and memtide's items are removed all the same, so torch's
    own "unrecognized key" does not hide it.
    """
    origin: List[str] = []
    took_any = False
    for var in CONF_VARS:
        text = environ.get(var)
        if text is None or "memtide" not in text.lower():
            continue
        took_any = True
        try:
            kept, selected, opts = split(var, text)
            inherited = origins(environ)  # set from a parent's variable, not by the user: replaced
            for option, (value, item) in opts.items():
                env = env_name(option)
                if env in environ and option not in inherited and not same_value(environ[env], value):
                    raise AllocConfError(f"{var} item {item!r} disagrees with {env}={environ[env]!r}; set one of them")
            for option, (value, item) in opts.items():
                environ[env_name(option)] = value
                origin.append(f"{option}={var} item {item}")
            if selected:
                environ[SELECTED] = "1"
        except AllocConfError as e:
            environ.setdefault(ERROR, str(e))
            kept = [i.strip() for i in text.split(",") if i.strip() and not is_memtide_item(i)]
        if kept:
            environ[var] = ",".join(kept)
        else:
            del environ[var]
    if took_any and environ is os.environ and os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0":
        import atexit

        atexit.register(_unapplied_warning)
    if origin:
        # This process's items replace what a parent's recorded for the same options.
        mine = {entry.partition("=")[0] for entry in origin}
        previous = [e for e in filter(None, environ.get(ORIGIN, "").split(";")) if e.partition("=")[0] not in mine]
        environ[ORIGIN] = ";".join(previous + origin)


def check(environ: MutableMapping[str, str] = os.environ) -> None:
    """Raises AllocConfError if strip_environ found a problem in this process or a parent."""
    message = environ.get(ERROR)
    if message:
        raise AllocConfError(message)


def origins(environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """option -> "VAR item memtide_<option>:<value>" for options set through a variable."""
    out: Dict[str, str] = {}
    for entry in filter(None, environ.get(ORIGIN, "").split(";")):
        option, _, where = entry.partition("=")
        out[option] = where
    return out


def pending(environ: MutableMapping[str, str] = os.environ) -> bool:
    """True while a variable still holds memtide items: site.py did not run the .pth hook
    (``python -S``, or an interpreter whose site-packages are only on PYTHONPATH)."""
    return any(is_memtide_item(item) for var in CONF_VARS for item in environ.get(var, "").split(","))


def torch_autoload() -> None:
    """torch.backends entry point: validate memtide's items and install memtide if asked."""
    if pending():
        strip_environ()  # the .pth hook did not run; CUDA has not started, so it is not too late
    if not (os.environ.get(ERROR) or os.environ.get(SELECTED) or os.environ.get(ORIGIN)):
        return  # the common case: memtide is installed but not named; do not load it
    import memtide

    memtide.apply_alloc_conf()
