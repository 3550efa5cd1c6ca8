"""The side-by-side samples page as people see it: drawn by a real headless Chromium (tools/screenshot_page.py).
Chromium is a process, so this is the integration tier; the page's content is checked in
tests/unit/evaluation/test_side_by_side.py. CI installs chromium-headless-shell (.ci/run): without it these fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import REPO, load_tool, tool_in_process
from zero_recipes.evaluation.side_by_side import Decoding, write_side_by_side

screenshot_page = load_tool("screenshot_page")
GREEN = (0x1A, 0x7F, 0x37)  # the exact-match mark's colour (side_by_side.CSS)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if not any(shutil.which(b) for b in screenshot_page.BROWSERS):
        pytest.fail("no headless Chromium on PATH: apt-get install chromium-headless-shell (.ci/run installs it)")
    prompts = [
        {"prompt": "Which is larger, 37 or 52?", "reference": "52"},
        {"prompt": "<script>document.title='x'</script> & what now?", "reference": None},
        {"prompt": [{"role": "user", "content": "Reverse the words: red cat moon"}], "reference": "moon cat red"},
    ]
    columns = {"outputs/tiny-llama": ["37", "no idea", "red cat"], "outputs/tiny-sft": ["52", "", "moon cat red"]}
    out = tmp_path_factory.mktemp("page") / "samples"
    return write_side_by_side(out, prompts, columns, Decoding(), "tiny-llama vs tiny-sft")


def test_chromium_reads_the_prompts_labels_and_marks(page):
    dom = screenshot_page.dump_dom(page)
    for text in ("Which is larger, 37 or 52?", "Reverse the words: red cat moon", "outputs/tiny-llama"):
        assert text in dom
    assert "outputs/tiny-sft" in dom and "<b>✓</b> 2 / 2 exact" in dom and "<b>✓</b> 0 / 2 exact" in dom
    # the prompt's script is text on the page, not an element Chromium ran
    assert "<script" not in dom and "&lt;script&gt;document.title='x'&lt;/script&gt; &amp; what now?" in dom
    assert "<title>tiny-llama vs tiny-sft</title>" in dom


def test_the_screenshot_is_the_whole_page_in_pixels(page, tmp_path):
    from PIL import Image

    out = tmp_path / "shot.png"
    # as a user runs it: a real process, its exit code and the path it prints
    proc = subprocess.run(
        [sys.executable, "tools/screenshot_page.py", str(page), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(out)
    assert out.stat().st_size > 10_000, f"a {out.stat().st_size}-byte PNG is too small to hold the page"
    img = Image.open(out).convert("RGB")
    # 1400 wide, cut below the table: taller than the header, far shorter than the window it was drawn in
    assert img.width == 1400 and 250 < img.height < screenshot_page.TALL
    colours = img.getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 20, "the screenshot is (nearly) one flat colour"
    # the exact-match bars are drawn: a few hundred pixels of the mark's green
    green = sum(n for n, rgb in colours if all(abs(a - b) < 12 for a, b in zip(rgb, GREEN)))
    assert green > 200, f"{green} pixels of the exact-match green"
    # a fixed window is kept as asked
    assert (
        tool_in_process("screenshot_page", page, tmp_path / "w.png", "--width", "900", "--height", "500").returncode
        == 0
    )
    assert Image.open(tmp_path / "w.png").size == (900, 500)


def test_without_chromium_the_tool_says_what_to_install(page, tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # an empty PATH: no browser to find
    proc = subprocess.run(
        [sys.executable, "tools/screenshot_page.py", str(page), str(tmp_path / "x.png")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: no headless Chromium on PATH; install it with `apt-get install chromium-headless-shell`"
    ]
