"""Progress of long restores: a tqdm bar, a plain line on stderr, or the caller's callable."""

from __future__ import annotations

import sys
from typing import Any, Callable

# progress=None shows a bar for restores of at least this many bytes (on a terminal).
PROGRESS_MIN_BYTES = 1 << 30


class _TextProgress:
    """A one-line progress display on stderr, for progress=True when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.shown = total, desc, -1

    def update_to(self, done: int) -> None:
        percent = 100 * done // self.total if self.total else 100
        if percent != self.shown:
            self.shown = percent
            sys.stderr.write(f"\r{self.desc}: {percent:3d}% of {format_bytes(self.total)}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown >= 0:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _TqdmProgress:
    def __init__(self, tqdm, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        file=sys.stderr)

    def update_to(self, done: int) -> None:
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class _CallbackProgress:
    def __init__(self, callback, total: int):
        self.callback, self.total = callback, total

    def update_to(self, done: int) -> None:
        self.callback(done, self.total)

    def close(self) -> None:
        pass


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - unreachable


def check(progress: Any) -> None:
    """TypeError unless `progress` is None, True, False or a callable."""
    if progress is None or progress is True or progress is False or callable(progress):
        return
    raise TypeError(f"progress must be None, True, False or a callable, not {type(progress).__name__}")


def _display(progress: Any, total: int, desc: str):
    """What shows a restore's progress: None (nothing), or an object with update_to(done) and
    close(). See tensorstash.restore for the meaning of `progress`."""
    if progress is False:
        return None
    if progress is None or progress is True:
        if progress is None and (total < PROGRESS_MIN_BYTES or not _stderr_is_tty()):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return _TextProgress(total, desc) if progress else None
        return _TqdmProgress(tqdm, total, desc)
    return _CallbackProgress(progress, total)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class Reporter:
    """Forwards the engine's progress(done, total) calls to the display `progress` asks for
    (checked by check() beforehand), made on the first call, when the total is known."""

    def __init__(self, progress: Any, desc: str):
        self.progress, self.desc = progress, desc
        self.display = None
        self.started = False

    def callback(self) -> Callable[[int, int], None] | None:
        """What to pass to the engine: None when nothing is to be shown."""
        return None if self.progress is False else self

    def __call__(self, done: int, total: int) -> None:
        if not self.started:
            self.started = True
            self.display = _display(self.progress, total, self.desc)
        if self.display is not None:
            self.display.update_to(done)

    def close(self) -> None:
        if self.display is not None:
            self.display.close()
