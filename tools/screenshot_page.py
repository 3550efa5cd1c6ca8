"""Screenshot an HTML page (the side-by-side samples page, say) with headless Chromium, to look at a page
without a desktop or to commit a picture of it.

    python tools/screenshot_page.py eval/tiny-sft/samples.html page.png                     # 1400 px wide
    python tools/screenshot_page.py page.html out.png --width 1000 --height 800               # a fixed window
    python tools/screenshot_page.py page.html --dump-dom                                     # the DOM as rendered

Without --height the page is drawn in a tall window and the empty space below it is cut off, so the
picture is the whole page. Needs `chromium-headless-shell` (or `chromium`) on PATH.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser")
TALL = 6000  # px: the window a page without --height is drawn in before the blank below it is cut
MARGIN = 28  # px of background kept under the page's last line


class InputError(Exception):
    pass


def browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        raise InputError("no headless Chromium on PATH; install it with `apt-get install chromium-headless-shell`")
    return found


def _run(page: Path, *flags: str) -> str:
    if not page.is_file():
        raise InputError(f"{page} is not a file; give the HTML page to draw")
    # --no-sandbox: Chromium's sandbox refuses to start as root (CI, containers); a profile of its own per call
    # so two calls at once (pytest workers) do not share one
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        cmd += [f"--user-data-dir={profile}", *flags, page.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise InputError(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout


def dump_dom(page) -> str:
    """The page's DOM after Chromium has parsed it, as HTML text."""
    return _run(Path(page), "--dump-dom")


def screenshot(page, out, width: int = 1400, height: int | None = None) -> Path:
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(Path(page), f"--screenshot={out}", f"--window-size={width},{height or TALL}")
    if not out.is_file():
        raise InputError(f"Chromium wrote no screenshot to {out}")
    if height is None and not _trim_bottom(out):
        print(f"warning: the page is longer than {TALL} px and was cut there; pass --height", file=sys.stderr)
    return out


def _trim_bottom(png: Path) -> bool:
    """Cut the rows below the page's content (all the colour of the last row), keeping MARGIN of them.
    False when the content reaches the window's bottom: the page goes on below it."""
    from PIL import Image, ImageChops  # Pillow: matplotlib's own dependency, in requirements.txt through it

    img = Image.open(png).convert("RGB")
    blank = Image.new("RGB", img.size, img.getpixel((0, img.height - 1)))
    box = ImageChops.difference(img, blank).getbbox()
    bottom = min(img.height, (box[3] if box else 0) + MARGIN)
    # palette PNG: a page is a few flat colours and anti-aliased text, and it keeps a committed picture small
    img.crop((0, 0, img.width, bottom)).quantize(256).save(png, optimize=True)
    return box is None or box[3] < img.height


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", type=Path, help="the HTML file")
    ap.add_argument("out", type=Path, nargs="?", help="the PNG to write (not with --dump-dom)")
    ap.add_argument("--width", type=int, default=1400, help="window width in px (default 1400)")
    ap.add_argument("--height", type=int, help="window height in px (default: the whole page)")
    ap.add_argument("--dump-dom", action="store_true", help="print the rendered DOM instead of a screenshot")
    args = ap.parse_args(argv)
    try:
        if args.dump_dom:
            print(dump_dom(args.page))
            return 0
        if args.out is None:
            raise InputError("give the PNG to write: screenshot_page.py PAGE.html OUT.png")
        if args.width < 1 or (args.height is not None and args.height < 1):
            raise InputError("--width and --height must be positive numbers of pixels")
        print(screenshot(args.page, args.out, args.width, args.height))
    except (InputError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
