"""sqlite-utils' `Database`, loaded without numpy.

sqlite-utils imports numpy when it is installed, only to map numpy's scalar types to column
types; the store never writes one (its values are JSON text, strings and Python numbers).
numpy is installed beside Stoker (the gguf package needs it), and loading it there cost
~0.13 s of CPU at every daemon start, before the daemon served anything. So numpy is hidden
while sqlite-utils loads (an import of it raises ImportError, the case sqlite-utils handles
as "not installed"); a process that already holds numpy keeps sqlite-utils' mapping.
"""

from __future__ import annotations

import sys

if "numpy" in sys.modules or "sqlite_utils.db" in sys.modules:
    from sqlite_utils import Database
else:
    # None in sys.modules is the import system's "not importable": `import numpy` raises ImportError.
    sys.modules["numpy"] = None  # type: ignore[assignment]
    try:
        from sqlite_utils import Database
    finally:
        del sys.modules["numpy"]

__all__ = ["Database"]
