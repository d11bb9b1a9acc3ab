"""Where a zoo network's step spends its GPU time: the kernels of one fluxpy mode and one PyTorch mode of
``zoo.py``'s networks, side by side (``captured_profile.py``'s method: each step replayed ``--steps`` times under
``torch.profiler``, kernels grouped by what they do, the busiest listed by name).

Run (GPU, PyTorch): ``PYTHONPATH=. python3 benchmarks/zoo_profile.py --cases vgg:1024,mobilenet:256
[--fluxpy "fluxpy bfloat16"] [--torch "torch autocast graph"] [--steps 20] [--top 12]``
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captured_profile import by_kind, profile_side  # noqa: E402
from zoo import fluxpy_side, make_case, torch_side  # noqa: E402


def _rows(sides, top):
    """The markdown lines: GPU us per step by kind, then the ``top`` busiest kernels of each side."""
    kinds = sorted({k for s in sides.values() for k in s["kinds"]},
                   key=lambda k: -max(s["kinds"].get(k, (0, 0))[0] for s in sides.values()))
    names = list(sides)
    lines = [f"| kind | {' | '.join(names)} |", "|---|" + "---:|" * len(names)]
    for k in kinds:
        cells = [f"{s['kinds'].get(k, (0.0, 0.0))[0]:,.0f} ({s['kinds'].get(k, (0.0, 0.0))[1]:.0f})"
                 for s in sides.values()]
        lines.append(f"| {k} | {' | '.join(cells)} |")
    totals = [f"**{sum(us for us, _ in s['kernels'].values()):,.0f}** (wall {s['wall_us']:,.0f})"
              for s in sides.values()]
    lines.append(f"| total GPU us per step | {' | '.join(totals)} |")
    for side, s in sides.items():
        lines.append(f"\n{side}: the {top} busiest kernels (GPU us per step, launches per step)\n")
        busiest = sorted(s["kernels"].items(), key=lambda kv: -kv[1][0])[:top]
        lines += [f"- {us:,.0f} ({n:.0f}) `{name[:110]}`" for name, (us, n) in busiest]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="vgg:1024")
    p.add_argument("--fluxpy", default="fluxpy bfloat16")
    p.add_argument("--torch", default="torch autocast graph")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    import torch
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}; {args.steps} steps profiled per side")
    for case in args.cases.split(","):
        name, batch = case.split(":")
        net, model, x, labels = make_case(name, int(batch))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fstep, _ = fluxpy_side(net, model, x, labels, args.fluxpy, "gpu")
            tstep, _ = torch_side(torch, net, model, x, labels, args.torch, "gpu")
        sides = {}
        for side, step in ((args.fluxpy, fstep), (args.torch, tstep)):
            kernels, wall = profile_side(torch, step, args.steps)
            sides[side] = {"wall_us": wall, "kernels": kernels, "kinds": by_kind(kernels)}
        print(f"\n### {case}: GPU us per step by kind of kernel (launches per step)\n")
        print(_rows(sides, args.top), flush=True)


if __name__ == "__main__":
    main()
