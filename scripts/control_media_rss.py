"""The rank's peak RSS while it reads a ControlNet request's media, above a plain request: issue 54's bomb files
(built here) through `h3serve.rank.media_conditioning.control_pixels`, each in a fresh process whose address space
is capped (a bomb that asks for 20 GiB gets a MemoryError instead of taking the machine). Runs against any
checkout that has `control_pixels` (docs/reliability.md records one run before the fix and one after).

    python scripts/control_media_rss.py WORKDIR [--canvas tiny|released] [--cap-gib 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from media_files import h264_clip, png_bomb  # noqa: E402

CANVASES = {"tiny": (64, 64 * 128), "released": (768, 1_032_192)}  # (short edge, max pixels): 128x64, 1344x768

PROBE = textwrap.dedent("""
    import dataclasses, json, re, resource, sys
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[4]) * 2**30,) * 2)
    import torch  # noqa: F401 (the rank's imports, before the baseline)
    from h3serve.rank.media_conditioning import control_pixels
    from h3serve.rules.request import ControlRequest, GenerationRequest, MediaRef
    from h3serve.rules.validate import ModelDefaults, validate

    def status(key):
        return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024

    defaults = ModelDefaults(canvas_short_edge=int(sys.argv[2]), canvas_max_pixels=int(sys.argv[3]))
    if "controlnet" in {f.name for f in dataclasses.fields(defaults)}:
        defaults = dataclasses.replace(defaults, controlnet=True)
    plain = validate(GenerationRequest(prompt="x", duration_s=4, steps=1), defaults)
    control_pixels(plain)
    part, path = sys.argv[1].split("=", 1)
    kind = "inpaint" if part == "mask" else "depth"
    control = ControlRequest(kind, **{part: MediaRef(Path(path), Path(path).name)})
    plan = validate(GenerationRequest(prompt="x", duration_s=4, steps=1, control=control), defaults)
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    try:
        pixels = control_pixels(plan)
        outcome = "decoded to " + "x".join(map(str, getattr(pixels, part).shape))
    except MemoryError as e:
        outcome = f"MemoryError ({e})"
    except Exception as e:
        outcome = f"{type(e).__name__}: {str(e)[:150]}"
    print(json.dumps({"base_mib": base, "peak_mib": status("VmHWM"), "outcome": outcome}))
""")


def build(folder: Path) -> dict[str, tuple[str, Path]]:
    """Issue 54's files: (part, path) by name."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "8192x8192 one-frame H.264 control video": ("control", h264_clip(folder / "c8192.mp4", 8192, 8192)),
        "1024x1024 one-frame H.264 control video": ("control", h264_clip(folder / "c1024.mp4", 1024, 1024)),
        "12000x12000 PNG mask": ("mask", png_bomb(folder / "m12000.png", 12000, 12000)),
        "20000x20000 PNG mask": ("mask", png_bomb(folder / "m20000.png", 20000, 20000)),
        "20000x20000 truncated PNG mask": ("mask", png_bomb(folder / "t20000.png", 20000, 20000, truncated=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--canvas", choices=CANVASES, default="tiny")
    parser.add_argument("--cap-gib", type=int, default=8, help="address-space cap of each probe process")
    args = parser.parse_args()
    short, pixels = CANVASES[args.canvas]
    print(f"| File | Size | Peak RSS above a plain request ({args.canvas} canvas) | Outcome |")
    print("| --- | --- | --- | --- |")
    for name, (part, path) in build(args.workdir).items():
        run = subprocess.run([sys.executable, "-c", PROBE, f"{part}={path}", str(short), str(pixels),
                              str(args.cap_gib)], capture_output=True, text=True, timeout=1800, check=False)
        if run.returncode != 0:
            print(f"| {name} | {path.stat().st_size:,} B | - | probe exited {run.returncode}: "
                  f"{run.stderr.strip().splitlines()[-1][:150] if run.stderr.strip() else ''} |")
            continue
        figures = json.loads(run.stdout.strip().splitlines()[-1])
        grown = figures["peak_mib"] - figures["base_mib"]
        print(f"| {name} | {path.stat().st_size:,} B | {grown:,.0f} MiB | {figures['outcome']} |", flush=True)


if __name__ == "__main__":
    main()
