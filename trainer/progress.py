"""Progress of the long commands (the layout planner, the dry run) on stderr, so that a user tells a
slow run from a hung one, and stdout (the planner's table, the dry run's report) stays as it was.

On a terminal `Progress` is tqdm's bar, one line redrawn in place. Elsewhere (a Slurm log, CI, a
pipe) tqdm's redraws would pile up as carriage returns in one endless line, so it prints a plain
line every `PLAIN_EVERY_S` seconds and one at the end; `phase` prints one plain line either way.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

# Seconds between the plain progress lines off a terminal: a log a user tails shows life at once
# and stays short over the minutes of a 671B plan.
PLAIN_EVERY_S = 10.0


def phase(text: str) -> None:
    """One plain line on stderr, on a terminal or not (a step of a command: building, rehearsing)."""
    print(text, file=sys.stderr, flush=True)


class Progress:
    """`total` items of work named `what` (e.g. "plan: layouts"): call `update(n, **counts)` as
    they are done, with counts worth showing (``fit=12``), then `close(**counts)`."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0
        self.counts: dict[str, int] = {}
        self.start = self.last = time.monotonic()
        self.bar = tqdm(total=total, desc=what, file=sys.stderr, leave=False, dynamic_ncols=True) \
            if sys.stderr.isatty() else None

    def update(self, n: int = 1, **counts: int) -> None:
        self.done += n
        self.counts.update(counts)
        if self.bar is not None:
            self.bar.update(n)
            if counts:
                self.bar.set_postfix(counts, refresh=False)
        elif time.monotonic() - self.last >= PLAIN_EVERY_S:
            self.last = time.monotonic()
            phase(self._line())

    def close(self, **counts: int) -> None:
        """Ends the bar with a plain line of the totals (`counts`: their final values)."""
        self.counts.update(counts)
        if self.bar is not None:
            self.bar.close()
        phase(self._line(final=True))

    def _line(self, final: bool = False) -> str:
        elapsed = time.monotonic() - self.start
        counts = "".join(f", {name} {value}" for name, value in self.counts.items())
        share = f"{self.done}/{self.total} ({self.done / self.total:.0%})" if self.total else f"{self.done}"
        if final:
            return f"{self.what}: {share}{counts}, done in {elapsed:.0f} s"
        left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        return f"{self.what}: {share}{counts}, {elapsed:.0f} s elapsed, about {left:.0f} s left"
