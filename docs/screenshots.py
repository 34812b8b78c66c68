"""Screenshots of the reports as a person reads them: a real ``tensorboard`` in headless Chromium.

Starts ``tensorboard --logdir LOGDIR`` on a free local port, waits until it has loaded the
event files, and saves a screenshot of the Text, Images and Scalars tabs, each filtered to the
``metastore`` tags, as ``<out>/<name>-{text,images,scalars}.png`` (palette PNGs of a few hundred
KB at most). Chromium is Debian's ``chromium`` package::

    apt-get update && apt-get install -y chromium

Without it (or with ``$CHROMIUM`` naming no program) the script says so and exits 0, having done
nothing. Run on an example's output, e.g.::

    nice -n 10 python examples/lightning_digits.py --out runs/lightning-digits
    python docs/screenshots.py runs/lightning-digits/tb --name digits           # docs/digits-*.png
    python docs/screenshots.py runs/finetune-bert/runs --name minilm --height 2400
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

#: the tabs shot, each as TensorBoard's URL fragment names it
TABS = ("text", "images", "scalars")
#: Chromium's headless flags: no sandbox (root in a container), nothing fetched from the network
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
INSTALL = "apt-get update && apt-get install -y chromium"


def find_chromium() -> str | None:
    """The Chromium program: ``$CHROMIUM`` when set, else ``chromium`` / ``chromium-browser`` on the PATH."""
    named = os.environ.get("CHROMIUM")
    if named is not None:
        return shutil.which(named)
    return next((found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(port: int, path: str, **query: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for_reports(port: int, server: subprocess.Popen[bytes], seconds: float = 120) -> None:
    """Until the server answers and lists the reports' text tags (its first load of the event files)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"tensorboard exited with status {server.returncode}")
        try:
            if any(
                tag.startswith("metastore/") for tags in get(port, "/data/plugin/text/tags").values() for tag in tags
            ):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"tensorboard on port {port} listed no metastore/ text tags in {seconds:.0f} s")


def shoot(chromium: str, url: str, path: Path, width: int, height: int, wait_ms: int) -> None:
    """One screenshot of ``url`` into ``path`` by a fresh headless Chromium (its own profile directory)."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={path}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )


def compress(path: Path, colours: int = 128) -> int:
    """Rewrite the PNG at ``path`` as an optimized palette PNG; its new size in bytes."""
    from PIL import Image

    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(
            colors=colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
    data = io.BytesIO()
    palette.save(data, format="PNG", optimize=True)
    path.write_bytes(data.getvalue())
    return len(data.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir", type=Path, help="the TensorBoard log directory of a run")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="default: docs/")
    parser.add_argument("--name", default="reports", help="file names <name>-<tab>.png")
    parser.add_argument("--width", type=int, default=1800)
    parser.add_argument("--height", type=int, default=1600)
    parser.add_argument("--wait-ms", type=int, default=15000, help="virtual time Chromium gives the page")
    parser.add_argument("--tabs", nargs="+", default=list(TABS), choices=TABS)
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print(f"skipped: no Chromium found (install it with: {INSTALL}; or set CHROMIUM to its program)")
        return 0
    if not args.logdir.is_dir():
        parser.error(f"no log directory {args.logdir}")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(args.logdir), "--host", "127.0.0.1"]
        + ["--port", str(port), "--reload_interval", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_reports(port, server)
        args.out.mkdir(parents=True, exist_ok=True)
        for tab in args.tabs:
            path = args.out / f"{args.name}-{tab}.png"
            shoot(
                chromium,
                f"http://127.0.0.1:{port}/#{tab}&tagFilter=metastore",
                path,
                args.width,
                args.height,
                args.wait_ms,
            )
            print(f"{path}: {compress(path) // 1024} KiB")
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
