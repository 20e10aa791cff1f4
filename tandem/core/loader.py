"""User functions named in a job file: `package.module:function` or `path/to/file.py:function`.

Importing one runs user code, so this is called where the function runs (the rollout worker) and by
`tandem check`, never by schema validation."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load_function(spec: str):
    """`package.module:function`, `path/to/file.py:function`, or `path/to/functions.pkl:name` (functions given from
    Python, pickled by value into the run directory: tandem.services.app.trainer) -> the callable."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError("expected 'module:function' or 'path/to/file.py:function'")
    target, name = spec.rsplit(":", 1)
    if target.endswith(".pkl"):
        fn = _pickled(target).get(name)
        if fn is None or not callable(fn):
            raise ValueError(f"{target!r} holds no function {name!r}")
        return fn
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"file {target!r} not found")
        mod_name = f"tandem_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        mod = sys.modules.get(mod_name)
        if mod is None:
            s = importlib.util.spec_from_file_location(mod_name, path)
            mod = importlib.util.module_from_spec(s)
            sys.modules[mod_name] = mod
            try:
                s.loader.exec_module(mod)
            except Exception as e:
                del sys.modules[mod_name]
                raise ValueError(f"importing {target!r} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            mod = importlib.import_module(target)
        except Exception as e:
            raise ValueError(f"cannot import module {target!r}: {type(e).__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{target!r} has no function {name!r}")
    return fn


def shown_name(spec: str) -> str:
    """A function as an error message names it: a function given from Python by its own name (its spec is the
    pickle's path, which its author never wrote), one from a job file as written there."""
    target, _, name = str(spec).rpartition(":")
    return name if target.endswith(".pkl") else str(spec)


def _pickled(path: str) -> dict:
    """The {name: function} a GRPOTrainer pickled (cloudpickle, by value), read once per process and version; from a
    storage URI where the run directory is one (every node reads it there: tandem.core.storage)."""
    from tandem.core.storage import Store, first_line, is_uri

    if is_uri(path):
        try:
            key, data = (path, Store(path).size("")), None
            if key not in _PICKLED:
                data = Store(path).read_bytes("")
        except OSError as e:
            raise ValueError(f"file {path!r} cannot be read on this node ({first_line(e)})") from None
    else:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"file {path!r} not found (the functions given to tandem.GRPOTrainer are pickled there)")
        key, data = (str(p.resolve()), p.stat().st_mtime_ns), None
        if key not in _PICKLED:
            data = p.read_bytes()
    if key not in _PICKLED:
        import pickle  # cloudpickle's output loads with pickle; the classes it names are cloudpickle's own

        try:
            _PICKLED[key] = pickle.loads(data)
        except Exception as e:
            raise ValueError(f"unpickling {path!r} failed: {type(e).__name__}: {e}") from None
    return _PICKLED[key]


_PICKLED: dict[tuple[str, int], dict] = {}
