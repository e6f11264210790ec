"""Whether a GPU of compute capability X can run code built for CMAKE_CUDA_ARCHITECTURES Y.

The rules (CUDA compatibility guide):
- `NN-real` is SASS for sm_NN: it runs on the same major version with an equal or higher
  minor (an 8.6 binary runs on 8.9, not on 8.0 and not on 9.0).
- `NN-virtual` is PTX for compute_NN: the driver JIT-compiles it for any GPU with
  capability >= NN (so 80-virtual runs on 9.0, slowly the first time).
- a bare `NN` means both. Arch-specific variants (`90a`, `100a`, `120a`) run only on
  exactly that capability, SASS and PTX alike. `all`/`all-major`/`native` cannot be
  judged from the name and are trusted.
"""

from __future__ import annotations

import re
from typing import Iterable

import attrs

_ARCH = re.compile(r"^(\d+)([af]?)(?:-(real|virtual))?$")
_TRUSTED = frozenset({"all", "all-major", "native"})


@attrs.frozen
class CudaArch:
    major: int
    minor: int
    specific: bool  # the 'a' / 'f' suffix
    real: bool
    virtual: bool
    text: str

    @classmethod
    def parse(cls, text: str) -> "CudaArch":
        """'90-real', '80-virtual', '86', '120a-real' -> CudaArch; ValueError otherwise."""
        m = _ARCH.match(text.strip())
        if m is None:
            raise ValueError(f"not a CUDA architecture: {text!r}")
        digits, suffix, kind = m.groups()
        number = int(digits)
        return cls(
            major=number // 10,
            minor=number % 10,
            specific=bool(suffix),
            real=kind in (None, "real"),
            virtual=kind in (None, "virtual"),
            text=text.strip(),
        )

    def runs_on(self, cc: tuple[int, int]) -> bool:
        """Whether this build target runs on a GPU of compute capability `cc`."""
        mine = (self.major, self.minor)
        if self.specific:
            return cc == mine
        if self.real and cc[0] == self.major and cc[1] >= self.minor:
            return True
        return self.virtual and cc >= mine


def parse_cc(text: str | None) -> tuple[int, int] | None:
    """'9.0' -> (9, 0); None or junk -> None."""
    m = re.match(r"^\s*(\d+)\.(\d+)\s*$", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def archs_for(capabilities: Iterable[str | None]) -> tuple[str, ...]:
    """The CMAKE_CUDA_ARCHITECTURES that build real code for exactly these GPUs: each compute
    capability once ('9.0' -> '90-real'), lowest first; unreadable ones are left out."""
    ccs = sorted({cc for cc in (parse_cc(text) for text in capabilities) if cc is not None})
    return tuple(f"{major}{minor}-real" for major, minor in ccs)


def split_archs(archs: Iterable[str] | str | None) -> tuple[str, ...]:
    """A list, or CMake's ';'-separated string, of architectures."""
    if archs is None:
        return ()
    if isinstance(archs, str):
        archs = archs.replace(",", ";").split(";")
    return tuple(a.strip() for a in archs if a and a.strip())


def cc_supported(cc: tuple[int, int], archs: Iterable[str] | str | None) -> bool | None:
    """True if any listed architecture runs on `cc`; None when the list says nothing."""
    names = split_archs(archs)
    if not names or any(a in _TRUSTED for a in names):
        return None
    parsed = []
    for name in names:
        try:
            parsed.append(CudaArch.parse(name))
        except ValueError:
            continue
    if not parsed:
        return None
    return any(a.runs_on(cc) for a in parsed)
